"""Generic verbs over every kind the server registers: get, describe, apply, delete."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import click

from cpn.cli.ctl import output
from cpn.cli.ctl.code import upload_code
from cpn.cli.ctl.context import Ctx, pass_ctx
from cpn.cli.ctl.main import cli
from cpn.core.manifest import ManifestSyntaxError, load_yaml_all

OUTPUT = click.option("-o", "--output", "fmt", type=click.Choice(["table", "wide", "json", "yaml"]),
                      default="table", show_default=True, help="Output format.")


def emit(obj: Any, fmt: str, columns: list[dict[str, Any]] | None = None, namespace: str | None = None) -> None:
    if fmt in ("json", "yaml"):
        click.echo(output.dump(obj, fmt))
        return
    items = obj["items"] if obj.get("kind") == "List" else [obj]
    if not items:  # as kubectl says it; a user sees only their own namespace's objects
        click.echo(f"No resources found in namespace {namespace}." if namespace else "No resources found.", err=True)
        return
    click.echo(output.table(items, columns or [], wide=fmt == "wide"))


@cli.command()
@click.argument("kind")
@click.argument("name", required=False)
@click.option("-l", "--selector", default=None, help="Label selector, e.g. -l env=prod,tier!=edge")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Show at most this many objects in all (the server pages; a note says when more exist).")
@click.option("--job", default=None, help="Only objects of this job (events, subtasks, reservations).")
@click.option("-w", "--watch", is_flag=True,
              help="After listing, print each object again whenever it changes (Ctrl-C stops; watching one "
                   "job stops when it ends).")
@click.option("--watch-interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between two looks while watching.")
@OUTPUT
@pass_ctx
def get(obj: Ctx, kind: str, name: str | None, selector: str | None, limit: int | None, job: str | None,
        watch: bool, watch_interval: float, fmt: str) -> None:
    """List objects of KIND, or show one by NAME; -w keeps watching."""
    k = obj.kind(kind)
    path = k["path"]
    if watch:
        if "{parent}" in path:
            raise click.UsageError(f"cannot watch {k['plural']}: get them again (cpnctl get {k['plural']} PARENT)")
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends a watch, as in kubectl
            _watch(obj, k, name, selector, job, fmt, watch_interval)
        return
    if "{parent}" in path:
        if not name:
            raise click.UsageError(f"{k['plural']} belong to a parent: cpnctl get {k['plural']} PARENT")
        listing = obj.client.get(path.replace("{parent}", obj.ref(name)))
        if k["kind"] == "Quote" and fmt not in ("json", "yaml"):
            listing["items"] = accepted_marked(listing["items"])
            if not listing["items"]:
                click.echo(_no_quotes(obj, name), err=True)
                return
        emit(listing, fmt, k["columns"])
        return
    if name:
        emit(get_one(obj, k, name), fmt, k["columns"])
        return
    items, more = list_all(obj, path, selector=selector, limit=limit, job=job)
    emit({"apiVersion": "cpn/v1", "kind": "List", "items": items}, fmt, k["columns"], obj.namespace)
    if more:
        click.echo(f"(showing the first {limit}; more exist: raise --limit to see them)", err=True)


ENDED = frozenset({"Succeeded", "Failed", "Cancelled"})


def _watch(obj: Ctx, k: dict[str, Any], name: str | None, selector: str | None, job: str | None, fmt: str,
           interval: float) -> None:
    """kubectl's -w by polling: the listing once, then each object whose row (or, with -o json|yaml,
    whose document) changed, and a new one as it appears. A single object stops being watched when
    it is gone or, for a job, when it ended."""
    shown: dict[str, str] = {}
    first = True
    while True:
        items = [get_one(obj, k, name)] if name else list_all(obj, k["path"], selector=selector, limit=None,
                                                              job=job)[0]
        changed = []
        for item in items:
            meta = item.get("metadata") or {}
            key = f"{meta.get('namespace', '')}/{meta.get('name') or meta.get('uid')}"
            text = output.dump(item, fmt) if fmt in ("json", "yaml") else output.table(
                [item], k["columns"], wide=fmt == "wide").splitlines()[1]
            if shown.get(key) != text:
                shown[key] = text
                changed.append((item, text))
        if first and fmt not in ("json", "yaml"):
            if changed:
                click.echo(output.table([i for i, _ in changed], k["columns"], wide=fmt == "wide"))
            else:
                click.echo("No resources found; watching for new ones.", err=True)
        else:
            for _, text in changed:
                click.echo(text)
        first = False
        if name and (item_phase(items[0]) in ENDED):
            return
        time.sleep(interval)


def item_phase(item: dict[str, Any]) -> str | None:
    return (item.get("status") or {}).get("phase") if item.get("kind") == "TrainingJob" else None


def get_one(obj: Ctx, k: dict[str, Any], name: str) -> dict[str, Any]:
    """One object of kind `k` by name. A kind the server only lists (invoices, reservations, …: no
    GET {path}/{name}) is found in its listing; a missing one is one line naming it."""
    if "get" in k.get("verbs", ["get"]):
        return obj.client.get(f"{k['path']}/{obj.ref(name)}")
    items, _ = list_all(obj, k["path"], selector=None, limit=None, job=None)
    wanted = obj.qualified(name)
    for item in items:
        meta = item.get("metadata") or {}
        if name in (meta.get("name"), meta.get("uid")) or wanted == f"{meta.get('namespace')}/{meta.get('name')}":
            return item
    hint = (f" (a job's {k['plural']}: cpnctl get {k['plural']} --job {name})"
            if k["kind"] in ("Invoice", "Reservation", "Event") else "")
    raise click.ClickException(f'{k["singular"]} "{name}" not found{hint}')


def accepted_marked(quotes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Quotes with CHOSEN `*` on the accepted one only: before an accept the server marks the recommended
    quote there, which its NOTE already says ("recommended")."""
    return [{**q, "chosen": "*" if q.get("state") == "accepted" else ""} for q in quotes]


def _no_quotes(obj: Ctx, job: str) -> str:
    """Why JOB has no quotes to show, from its phase (a profile run quotes only once it has measured)."""
    manifest = obj.client.get(f"/api/v1/jobs/{obj.ref(job)}")
    meta, phase = manifest.get("metadata") or {}, (manifest.get("status") or {}).get("phase")
    shown = f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else meta.get("name", job)
    if phase in ("Pending", "Profiling"):
        return f"No quotes yet: job {shown} is {phase}; its quotes follow the profile run" if phase == "Profiling" \
            else f"No quotes yet: job {shown} is {phase}; it is quoted once the server has planned it"
    return f"No quotes: job {shown} is {phase}"


PAGE = 500


def list_all(obj: Ctx, path: str, *, selector: str | None, limit: int | None, job: str | None
             ) -> tuple[list[dict[str, Any]], bool]:
    """Every object (following continue tokens), or at most `limit` of them; True if more exist."""
    items: list[dict[str, Any]] = []
    token: str | None = None
    while limit is None or len(items) < limit:
        size = PAGE if limit is None else min(PAGE, limit - len(items))
        page = obj.client.get(path, labelSelector=selector, limit=size, job=obj.qualified(job),
                              namespace=obj.namespace, **{"continue": token})
        items.extend(page["items"])
        token = (page.get("metadata") or {}).get("continue")
        if not token:
            return items, False
    return items[:limit], True


@cli.command()
@click.argument("kind")
@click.argument("name")
@pass_ctx
def describe(obj: Ctx, kind: str, name: str) -> None:
    """Show one object in detail, with its conditions and events."""
    k = obj.kind(kind)
    if "{parent}" in k["path"]:  # quotes: those of the job NAME, each described
        items = obj.client.get(k["path"].replace("{parent}", obj.ref(name)))["items"]
        if k["kind"] == "Quote":
            items = accepted_marked(items)
        if not items:
            raise click.ClickException(_no_quotes(obj, name) if k["kind"] == "Quote"
                                       else f"{name} has no {k['plural']}")
        click.echo("\n\n".join(output.describe({"kind": k["kind"], "metadata": q.get("metadata") or {},
                                                  "spec": {c: v for c, v in q.items() if c != "metadata"}})
                                 for q in items))
        return
    manifest = get_one(obj, k, name)
    if k["kind"] == "TrainingJob":
        manifest["events"] = obj.client.get("/api/v1/events", job=obj.qualified(name))["items"]
        manifest["subtasks"] = obj.client.get(f"/api/v1/jobs/{obj.ref(name)}/subtasks")["items"]
        manifest["metrics"] = obj.client.get(f"/api/v1/jobs/{obj.ref(name)}/metrics", maxPoints=8, maxReports=0)
    click.echo(output.describe(manifest))


def _read_text(source: str) -> str:
    """The file's text; a missing or unreadable file is one line naming it, not Python's errno text."""
    if source == "-":
        return sys.stdin.read()
    try:
        return Path(source).read_text()
    except FileNotFoundError as exc:
        raise click.ClickException(f"{source}: no such file") from exc
    except UnicodeDecodeError as exc:
        raise click.ClickException(f"{source}: not a text file (byte {exc.start} is not UTF-8); give a YAML or JSON "
                                   "manifest") from exc
    except OSError as exc:
        raise click.ClickException(f"{source}: {(exc.strerror or str(exc)).lower()}") from exc


class DuplicateKey(ValueError):
    """A JSON object gave one key twice."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (json keeps the last silently, as PyYAML would)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise DuplicateKey(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def read_documents(source: str) -> list[dict[str, Any]]:
    text = _read_text(source)
    try:
        if source.endswith(".json") or text.lstrip().startswith(("{", "[")):
            loaded = json.loads(text, object_pairs_hook=_unique_keys)
            docs = loaded if isinstance(loaded, list) else [loaded]
        else:
            docs = load_yaml_all(text, source)
    except json.JSONDecodeError as exc:
        raise click.ClickException(f"{source}: malformed JSON at line {exc.lineno} column {exc.colno}: "
                                   f"{exc.msg}") from exc
    except ManifestSyntaxError as exc:
        raise click.ClickException(str(exc)) from exc
    except DuplicateKey as exc:
        raise click.ClickException(f"{source}: malformed JSON: {exc}") from exc
    except ValueError as exc:  # a YAML value its constructor refuses, e.g. the date 2026-02-30
        raise click.ClickException(f"{source}: malformed YAML: {exc}") from exc
    expanded: list[dict[str, Any]] = []
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "List":
            expanded.extend(doc.get("items") or [])
        else:
            expanded.append(doc)
    for i, doc in enumerate(expanded):
        if not isinstance(doc, dict):
            raise click.ClickException(f"{source}: document {i} is not a mapping")
    return expanded


@cli.command()
@click.option("-f", "--filename", "source", required=True, help="A YAML/JSON file, or - for stdin.")
@click.option("--dry-run", "dry_run", type=click.Choice(["none", "server"]), default="none", show_default=True,
              help="server: the server checks everything and prices jobs (their quotes are shown), stores nothing.")
@OUTPUT
@pass_ctx
def apply(obj: Ctx, source: str, dry_run: str, fmt: str) -> None:
    """Create or update every object in FILE, all or nothing."""
    result = apply_documents(obj, read_documents(source), source, dry=dry_run == "server")
    if fmt in ("json", "yaml"):
        click.echo(output.dump(result, fmt))
        return
    for item in result["items"]:
        click.echo(f"{item['kind'].lower()}/{item['name']} {item['action']}" + (" (server dry run)" if dry_run ==
                                                                                  "server" else ""))
        if item.get("quotes"):
            click.echo(output.table(accepted_marked(item["quotes"]), obj.kind("quotes")["columns"]))


def apply_documents(obj: Ctx, docs: list[dict[str, Any]], source: str, *, dry: bool = False) -> dict[str, Any]:
    """POST /api/v1/apply with `docs`: what can be checked here is checked first (numbers JSON carries, each
    job's code directory and entrypoint), then code is packed and uploaded, then the batch applied; the
    "code … packed … uploaded" lines are printed only once the server took the batch."""
    if not docs:
        raise click.ClickException(f"{source}: no objects to apply")
    for doc in docs:
        _refuse_non_finite(doc)
    # every job's code is checked before any is packed; spec.code.path → the uploaded bundle's digest (dry runs too)
    notes = upload_code(obj.client, docs, source)
    result = obj.client.request("POST", "/api/v1/apply", json={"items": docs},
                                params={"dryRun": "true"} if dry else None)
    for note in notes:
        click.echo(note, err=True)
    return result


def _non_finite(value: Any, path: str) -> str | None:
    """The path of the first number in `value` that JSON cannot carry (inf, -inf, nan: `1e400`, `.nan`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    if isinstance(value, dict):
        items: Any = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for where, inner in items:
        found = _non_finite(inner, where)
        if found:
            return found
    return None


def _refuse_non_finite(doc: dict[str, Any]) -> None:
    """One line naming the object and field of a non-finite number, as the server says it, before sending
    (the JSON encoder would refuse it with no field: "Out of range float values are not JSON compliant")."""
    where = _non_finite(doc, "")
    if where:
        name = (doc.get("metadata") or {}).get("name") if isinstance(doc.get("metadata"), dict) else None
        raise click.ClickException(f"{str(doc.get('kind') or 'object').lower()}/{name or '?'}: {where}: "
                                   "must be a finite number")


@cli.command()
@click.argument("kind", required=False)
@click.argument("names", nargs=-1)
@click.option("-f", "--filename", "source", default=None, help="Delete the objects in this YAML/JSON file (- for stdin).")
@pass_ctx
def delete(obj: Ctx, kind: str | None, names: tuple[str, ...], source: str | None) -> None:
    """Delete objects: KIND NAME... or -f FILE (every object the file describes)."""
    if source and (kind or names):
        raise click.UsageError("give either KIND NAME... or -f FILE, not both")
    if source:
        targets = [(doc.get("kind") or "", (doc.get("metadata") or {}).get("name") or "")
                   for doc in read_documents(source)]
    elif kind and names:
        targets = [(kind, name) for name in names]
    else:
        raise click.UsageError("what to delete: cpnctl delete KIND NAME... or cpnctl delete -f FILE")
    for kind_name, name in targets:
        k = obj.kind(str(kind_name))
        if not name:
            raise click.ClickException(f"{source}: a {k['kind']} without metadata.name")
        obj.client.delete(f"{k['path']}/{obj.ref(name)}")
        click.echo(f'{k["singular"]} "{name}" deleted')
