"""Generic verbs over every kind the server registers: get, describe, apply, delete."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
import yaml

from cpn.cli.ctl import output
from cpn.cli.ctl.context import Ctx, pass_ctx
from cpn.cli.ctl.main import cli

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
@click.option("--limit", type=int, default=None, help="Page size (follows continue tokens).")
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
        emit(obj.client.get(path.replace("{parent}", name)), fmt, k["columns"])
        return
    if name:
        emit(obj.client.get(f"{path}/{name}"), fmt, k["columns"])
        return
    items: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        page = obj.client.get(path, labelSelector=selector, limit=limit, job=job, **{"continue": token})
        items.extend(page["items"])
        token = (page.get("metadata") or {}).get("continue")
        if not token:
            break
    emit({"apiVersion": "cpn/v1", "kind": "List", "items": items}, fmt, k["columns"])


@cli.command()
@click.argument("kind")
@click.argument("name")
@pass_ctx
def describe(obj: Ctx, kind: str, name: str) -> None:
    """Show one object in detail, with its conditions and events."""
    k = obj.kind(kind)
    manifest = obj.client.get(f"{k['path']}/{name}")
    if k["kind"] == "TrainingJob":
        manifest["events"] = obj.client.get("/api/v1/events", job=name)["items"]
        manifest["subtasks"] = obj.client.get(f"/api/v1/jobs/{name}/subtasks")["items"]
    click.echo(output.describe(manifest))


def read_documents(source: str) -> list[dict[str, Any]]:
    text = sys.stdin.read() if source == "-" else Path(source).read_text()
    try:
        if source.endswith(".json") or text.lstrip().startswith(("{", "[")):
            loaded = json.loads(text)
            docs = loaded if isinstance(loaded, list) else [loaded]
        else:
            docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise click.ClickException(f"{source}: not valid YAML/JSON: {str(exc).splitlines()[0]}") from exc
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
@OUTPUT
@pass_ctx
def apply(obj: Ctx, source: str, fmt: str) -> None:
    """Create or update every object in FILE, all or nothing."""
    docs = read_documents(source)
    if not docs:
        raise click.ClickException(f"{source}: no objects to apply")
    result = obj.client.post("/api/v1/apply", json={"items": docs})
    if fmt in ("json", "yaml"):
        click.echo(output.dump(result, fmt))
        return
    for item in result["items"]:
        click.echo(f"{item['kind'].lower()}/{item['name']} {item['action']}")


@cli.command()
@click.argument("kind")
@click.argument("name")
@pass_ctx
def delete(obj: Ctx, kind: str, name: str) -> None:
    """Delete one object."""
    k = obj.kind(kind)
    obj.client.delete(f"{k['path']}/{name}")
    click.echo(f'{k["singular"]} "{name}" deleted')
