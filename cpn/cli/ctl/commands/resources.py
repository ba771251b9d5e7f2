"""Generic verbs over every kind the server registers: get, describe, apply, delete."""

from __future__ import annotations

import json
import sys
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


def emit(obj: Any, fmt: str, columns: list[dict[str, Any]] | None = None) -> None:
    if fmt in ("json", "yaml"):
        click.echo(output.dump(obj, fmt))
        return
    items = obj["items"] if obj.get("kind") == "List" else [obj]
    if not items:
        click.echo("No resources found.", err=True)
        return
    click.echo(output.table(items, columns or [], wide=fmt == "wide"))


@cli.command()
@click.argument("kind")
@click.argument("name", required=False)
@click.option("-l", "--selector", default=None, help="Label selector, e.g. -l env=prod,tier!=edge")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Show at most this many objects in all (the server pages; a note says when more exist).")
@click.option("--job", default=None, help="Only objects of this job (events, subtasks, reservations).")
@OUTPUT
@pass_ctx
def get(obj: Ctx, kind: str, name: str | None, selector: str | None, limit: int | None, job: str | None,
        fmt: str) -> None:
    """List objects of KIND, or show one by NAME."""
    k = obj.kind(kind)
    path = k["path"]
    if "{parent}" in path:
        if not name:
            raise click.UsageError(f"{k['plural']} belong to a parent: cpnctl get {k['plural']} PARENT")
        emit(obj.client.get(path.replace("{parent}", obj.ref(name))), fmt, k["columns"])
        return
    if name:
        emit(obj.client.get(f"{path}/{obj.ref(name)}"), fmt, k["columns"])
        return
    items, more = list_all(obj, path, selector=selector, limit=limit, job=job)
    emit({"apiVersion": "cpn/v1", "kind": "List", "items": items}, fmt, k["columns"])
    if more:
        click.echo(f"(showing the first {limit}; more exist: raise --limit to see them)", err=True)


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
    manifest = obj.client.get(f"{k['path']}/{obj.ref(name)}")
    if k["kind"] == "TrainingJob":
        manifest["events"] = obj.client.get("/api/v1/events", job=obj.qualified(name))["items"]
        manifest["subtasks"] = obj.client.get(f"/api/v1/jobs/{obj.ref(name)}/subtasks")["items"]
    click.echo(output.describe(manifest))


def _read_text(source: str) -> str:
    """The file's text; a missing or unreadable file is one line naming it, not Python's errno text."""
    if source == "-":
        return sys.stdin.read()
    try:
        return Path(source).read_text()
    except FileNotFoundError as exc:
        raise click.ClickException(f"{source}: no such file") from exc
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
    docs = read_documents(source)
    if not docs:
        raise click.ClickException(f"{source}: no objects to apply")
    params = {"dryRun": "true"} if dry_run == "server" else None
    upload_code(obj.client, docs, source)  # spec.code.path → an uploaded bundle's digest (also for a dry run)
    result = obj.client.request("POST", "/api/v1/apply", json={"items": docs}, params=params)
    if fmt in ("json", "yaml"):
        click.echo(output.dump(result, fmt))
        return
    for item in result["items"]:
        click.echo(f"{item['kind'].lower()}/{item['name']} {item['action']}" + (" (server dry run)" if params else ""))
        if item.get("quotes"):
            click.echo(output.table(item["quotes"], obj.kind("quotes")["columns"]))


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
