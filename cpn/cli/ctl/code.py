"""`spec.code.path` on the client: `cpnctl apply` packs the user's directory into a content-addressed
bundle (:func:`cpn.runtime.bundle.pack`), uploads it once (``HEAD`` then ``PUT
/api/v1/bundles/{sha256}``) and sends the job with ``spec.code.digest`` instead of the local path.
The server stores the bundle and never runs it; the sites' job runners fetch it by digest.

Before anything is packed or uploaded, every job's directory and ``spec.code.entrypoint``
(``module:function``) are checked by reading the module's source (:func:`entrypoint_problem`: ``ast``,
never an import), so a misspelt entrypoint is one line at apply time, not a failure on the sites."""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from cpn.client import Client
from cpn.core.settings import Settings
from cpn.runtime.bundle import BundleError, files_of, pack

# the client packs at most what a server with default settings accepts; a server's own limit answers 413
MAX_BYTES: int = Settings.model_fields["bundle_max_bytes"].default


@dataclass
class _Code:
    name: str
    code: dict[str, Any]
    root: Path


def _code_jobs(docs: list[dict[str, Any]], source: str) -> list[_Code]:
    """Every TrainingJob with a local ``spec.code.path``, its directory checked and its entrypoint read."""
    base = Path.cwd() if source == "-" else Path(source).resolve().parent
    found = []
    for doc in docs:
        code = (doc.get("spec") or {}).get("code") if str(doc.get("kind", "")).lower() == "trainingjob" else None
        if not isinstance(code, dict) or not code.get("path"):
            continue
        name = (doc.get("metadata") or {}).get("name", "?")
        root = (base / Path(str(code["path"])).expanduser()).resolve()
        if not root.is_dir():
            raise click.ClickException(f"{source}: trainingjob/{name}: spec.code.path {code['path']!r} is not a "
                                       f"directory (looked at {root}; relative paths start at the manifest's folder)")
        entrypoint = code.get("entrypoint")
        if isinstance(entrypoint, str):  # a missing or non-text entrypoint is the server's to name
            try:
                problem = entrypoint_problem(root, entrypoint)
            except BundleError as exc:
                raise click.ClickException(f"{source}: trainingjob/{name}: spec.code.path: {exc}") from None
            if problem:
                raise click.ClickException(f"{source}: trainingjob/{name}: spec.code.entrypoint {entrypoint!r}: "
                                           f"{problem}")
        found.append(_Code(name, code, root))
    return found


def upload_code(client: Client, docs: list[dict[str, Any]], source: str) -> list[str]:
    """Replace every TrainingJob's ``spec.code.path`` by the digest of the uploaded bundle (in place), once
    every job's code was checked. Returns a line per bundle for the caller to print once the apply
    succeeded (a refused apply prints only why)."""
    notes = []
    for job in _code_jobs(docs, source):  # all of them checked before the first is packed
        try:
            data, digest = pack(job.root, MAX_BYTES)
        except BundleError as exc:
            raise click.ClickException(f"{source}: trainingjob/{job.name}: spec.code.path: {exc}") from None
        path = f"/api/v1/bundles/{digest.removeprefix('sha256:')}"
        stored = client.exists(path)
        if not stored:
            client.put_bytes(path, data)
        notes.append(f"trainingjob/{job.name}: code {job.root} packed to {digest[:19]}… ({len(data):,} bytes), "
                     f"{'already uploaded' if stored else 'uploaded'}")
        job.code.pop("path")
        job.code["digest"] = digest
    return notes


def entrypoint_problem(root: Path, entrypoint: str) -> str | None:
    """What is wrong with ``module:function`` in the bundle packed from ``root`` (the files :func:`pack`
    takes), or None. Reads the module's source with ``ast``; never imports or runs it. A module that
    binds names in ways a reader cannot follow (``from x import *``, a module ``__getattr__``) passes."""
    module, _, function = entrypoint.partition(":")
    if not module or not function:
        return "write it as module:function (e.g. train:main)"
    files = set(files_of(root))
    rel = module.replace(".", "/")
    path = next((p for p in (f"{rel}.py", f"{rel}/__init__.py") if p in files), None)
    if path is None:
        modules = sorted({f.removesuffix("/__init__.py").removesuffix(".py").replace("/", ".")
                          for f in files if f.endswith(".py")})
        close = difflib.get_close_matches(module, modules, n=1, cutoff=0.6)
        hint = f"did you mean `{close[0]}`?" if close else (
            f"its modules: {', '.join(modules[:8])}" if modules else "it has no .py file")
        return (f"no module {module!r} in {root} (looked for {rel}.py and {rel}/__init__.py among the files "
                f"the bundle takes); {hint}")
    try:
        tree = ast.parse((root / path).read_bytes(), filename=path)
    except SyntaxError as exc:
        return f"{path} line {exc.lineno}: {exc.msg} (Python cannot read the module: fix it before submitting)"
    except ValueError as exc:  # NUL bytes
        return f"{path} is not Python source ({exc})"
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = "function"
        elif isinstance(node, ast.ClassDef):
            names[node.name] = "class"
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names[(alias.asname or alias.name).split(".")[0]] = "import"
        else:
            for target in _bound(node):
                names.setdefault(target, "name")
    if function in names or "__getattr__" in names:
        return None
    functions = sorted(n for n, what in names.items() if what == "function" and not n.startswith("_"))
    close = difflib.get_close_matches(function, functions, n=1, cutoff=0.6)
    hint = f"did you mean `{module}:{close[0]}`?" if close else (
        f"its functions: {', '.join(functions[:8])}" if functions else "it defines no function")
    return f"{path} has no function {function!r}; {hint}"


def _bound(node: ast.stmt) -> list[str]:
    """Top-level names an assignment-like statement binds (``main = make()``, ``if …: def main``)."""
    out = []
    for inner in ast.walk(node):
        if isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
            out.append(inner.id)
        elif isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.append(inner.name)
    return out
