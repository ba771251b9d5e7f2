"""`spec.code.path` on the client: `cpnctl apply` packs the user's directory into a content-addressed
bundle (:func:`cpn.runtime.bundle.pack`), uploads it once (``HEAD`` then ``PUT
/api/v1/bundles/{sha256}``) and sends the job with ``spec.code.digest`` instead of the local path.
The server stores the bundle and never runs it; the sites' job runners fetch it by digest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from cpn.client import Client
from cpn.core.settings import Settings
from cpn.runtime.bundle import BundleError, pack

# the client packs at most what a server with default settings accepts; a server's own limit answers 413
MAX_BYTES: int = Settings.model_fields["bundle_max_bytes"].default


def upload_code(client: Client, docs: list[dict[str, Any]], source: str) -> None:
    """Replace every TrainingJob's ``spec.code.path`` by the digest of the uploaded bundle (in place)."""
    base = Path.cwd() if source == "-" else Path(source).resolve().parent
    for doc in docs:
        code = (doc.get("spec") or {}).get("code") if str(doc.get("kind", "")).lower() == "trainingjob" else None
        if not isinstance(code, dict) or not code.get("path"):
            continue
        name = (doc.get("metadata") or {}).get("name", "?")
        root = (base / Path(str(code["path"])).expanduser()).resolve()
        if not root.is_dir():
            raise click.ClickException(f"{source}: trainingjob/{name}: spec.code.path {code['path']!r} is not a "
                                       f"directory (looked at {root}; relative paths start at the manifest's folder)")
        try:
            data, digest = pack(root, MAX_BYTES)
        except BundleError as exc:
            raise click.ClickException(f"{source}: trainingjob/{name}: spec.code.path: {exc}") from None
        path = f"/api/v1/bundles/{digest.removeprefix('sha256:')}"
        stored = client.exists(path)
        if not stored:
            client.put_bytes(path, data)
        click.echo(f"trainingjob/{name}: code {root} packed to {digest[:19]}… ({len(data):,} bytes), "
                   f"{'already uploaded' if stored else 'uploaded'}", err=True)
        code.pop("path")
        code["digest"] = digest
