"""Printers: table / wide from the server's printer columns, json, yaml."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

import yaml
from pydantic.alias_generators import to_camel

from cpn.core.manifest import duration_text

PLACEHOLDER = re.compile(r"\{([^{}]+)\}")


def dig(obj: Any, path: str) -> Any:
    for part in path.split("."):
        if isinstance(obj, dict):
            obj = obj.get(part)
        else:
            return None
    return obj


def age(value: Any) -> str:
    if not value:
        return "<unknown>"
    try:
        then = datetime.fromisoformat(str(value))
    except ValueError:
        return "<unknown>"
    if then.tzinfo is None:
        then = then.replace(tzinfo=UTC)
    seconds = max(0, int((datetime.now(UTC) - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def render_cell(item: dict[str, Any], column: dict[str, Any]) -> str:
    template = column["template"]
    if column.get("format") == "age":
        return age(dig(item, template.strip("{}")))
    if column.get("format") == "duration":  # seconds, shown as `3 min 20 s`
        seconds = dig(item, template.strip("{}"))
        return duration_text(float(seconds)) if isinstance(seconds, int | float) else "-"

    found = []

    def sub(match: re.Match[str]) -> str:
        value = dig(item, match.group(1))
        if value is None or value == "" or value == []:
            return "-"
        found.append(value)
        if isinstance(value, list):
            return ",".join(str(v) for v in value)
        return str(value)

    text = PLACEHOLDER.sub(sub, template)
    return text if found else "-"  # nothing known yet: `-`, not `-%` or `- -`


def table(items: list[dict[str, Any]], columns: list[dict[str, Any]], wide: bool = False) -> str:
    cols = [c for c in columns if wide or not c.get("wide")]
    header = ["NAME", *[c["name"] for c in cols]]
    rows = [[str(dig(it, "metadata.name") or "-"), *[render_cell(it, c) for c in cols]] for it in items]
    namespaces = [str(dig(it, "metadata.namespace") or "") for it in items]
    if len(set(namespaces)) > 1:  # an admin's view of several accounts' jobs: say whose each is
        header, rows = ["NAMESPACE", *header], [[ns or "-", *row] for ns, row in zip(namespaces, rows, strict=True)]
    return format_rows(header, rows)


def format_rows(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["   ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
             for row in [header, *rows]]
    return "\n".join(lines)


def dump(obj: Any, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(obj, indent=2, default=str)
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False).rstrip()


# status keys that are the machinery's bookkeeping, not something a user reads
INTERNAL = frozenset({"meter", "billed", "sinceCheckpoint", "train", "topology", "ring", "quoteLines", "phaseTimes",
                      "checkpointEvery", "cancelRequested", "masterPort", "rendezvous"})


def _money(value: Any) -> str | None:
    if isinstance(value, dict) and value.get("total") is not None:
        return f"{value['total']} {value.get('currency', '')}".rstrip()
    return None


def _tokens_text(done: int, asked: Any, trained: Any) -> str:
    """Progress against what the run really trains (status.train), and the budget asked for when they differ."""
    if not isinstance(trained, int):
        return f"{done:,} of {asked:,}" if isinstance(asked, int) else f"{done:,}"
    if isinstance(asked, int) and trained != asked:
        return f"{done:,} of {trained:,} (spec.tokens {asked:,}, rounded to whole steps)"
    return f"{done:,} of {trained:,}"


def parameter_servers(strategy: Any) -> dict[str, Any] | None:
    """What a parameter-server run really runs with (its TrainConfig's strategy, the spec's knobs and the
    runtime's defaults applied): shards, copies of each, and ps_backup's backup workers. The orchestrator
    sets the shard count (``ps``) for the parameter-server strategies only."""
    if not isinstance(strategy, dict) or "ps" not in strategy:
        return None
    view = {"shards": strategy["ps"], "replicasPerShard": strategy.get("ps_replicas", 0)}
    if strategy["name"] == "ps_backup":
        view["backupWorkers"] = strategy.get("backup_workers")
    return view


def job_view(obj: dict[str, Any]) -> dict[str, Any]:
    """A TrainingJob as a person reads it: units on every figure (USD, s/min/h, tokens/s), no internals."""
    st = dict(obj.get("status") or {})
    view: dict[str, Any] = {"phase": st.get("phase"), "message": st.get("message"), "strategy": st.get("strategy"),
                            "attempt": st.get("attempt"), "sitesRunning": st.get("sites"), "quote": st.get("quote"),
                            "contract": st.get("contract"), "price": _money(st.get("price"))}
    if st.get("predictedSeconds") is not None:
        view["predictedTime"] = duration_text(float(st["predictedSeconds"]))
    view["placement"] = st.get("placement")
    servers = parameter_servers((st.get("train") or {}).get("strategy"))
    if servers:
        view["parameterServers"] = servers
    prog = st.get("progress") or {}
    if prog:
        view["progress"] = {
            "percent": f"{prog.get('percent', 0)} %",
            "tokens": _tokens_text(prog.get("tokens") or 0, (obj.get("spec") or {}).get("tokens"),
                                   (st.get("train") or {}).get("tokens")),
            "loss": prog.get("loss"), "valLoss": prog.get("valLoss"), "trainLoss": prog.get("trainLoss"),
            "throughput": f"{prog.get('tokensPerSecond', 0):,.1f} tokens/s",
            "eta": duration_text(float(prog.get("etaSeconds") or 0)) if prog.get("tokensPerSecond") else "unknown",
        }
    view["cost"] = _money(st.get("cost"))
    measured = st.get("measured") or {}
    if measured.get("wallSeconds") is not None:
        view["measured"] = {"wallTime": duration_text(float(measured["wallSeconds"])),
                            "predictedTime": duration_text(float(measured.get("predictedSeconds") or 0)),
                            "ratio": measured.get("ratio")}
    known = set(view) | {"predictedSeconds", "progress", "measured", "sites"}
    view.update({k: v for k, v in st.items() if k not in known and k not in INTERNAL})
    return {**obj, "status": view}


def describe(obj: dict[str, Any]) -> str:
    """kubectl-describe-like text: nested keys indented, conditions as a table."""
    if obj.get("kind") == "TrainingJob":
        obj = job_view(obj)
    lines: list[str] = []
    meta = obj.get("metadata", {})
    lines.append(f"Name:         {meta.get('name')}")
    lines.append(f"Kind:         {obj.get('kind')}")
    if meta.get("labels"):
        lines.append("Labels:       " + ",".join(f"{k}={v}" for k, v in meta["labels"].items()))
    lines.append(f"Created:      {meta.get('creationTimestamp')}  ({age(meta.get('creationTimestamp'))} ago)")
    lines.append(f"Version:      {meta.get('resourceVersion')}")
    for section in ("spec", "status"):
        value = dict(obj.get(section) or {})
        conditions = value.pop("conditions", None) if section == "status" else None
        if value:
            lines.append(f"{section.capitalize()}:")
            lines.extend(_nested(value, 2))
        if conditions:
            lines.append("Conditions:")
            rows = [[c.get("type", ""), c.get("status", ""), c.get("reason") or "", c.get("message") or ""]
                    for c in conditions]
            lines.extend("  " + line for line in format_rows(["TYPE", "STATUS", "REASON", "MESSAGE"], rows)
                         .splitlines())
    if obj.get("kind") == "Quota":
        lines.extend(quota_lines(obj))
    if obj.get("subtasks"):
        lines.append("Sub-tasks:")
        rows = [_subtask_row(t) for t in obj["subtasks"]]
        lines.extend("  " + line for line in format_rows(["NAME", "ATTEMPT", "SITE", "CLUSTER", "GPUS", "PHASE",
                                                          "LAUNCHES", "DEVICES"], rows).splitlines())
    if obj.get("metrics"):
        lines.append("Metrics:")
        lines.extend("  " + line for line in metric_lines(obj["metrics"]))
    for extra in ("events",):
        if obj.get(extra):
            lines.append("Events:")
            rows = [[age(e.get("at")), e.get("type", ""), e.get("reason", ""), e.get("message", "")]
                    for e in obj[extra]]
            lines.extend("  " + line for line in format_rows(["AGE", "TYPE", "REASON", "MESSAGE"], rows)
                         .splitlines())
    return "\n".join(lines)


QUOTA_LIMITS = (("maxGpus", "gpus", "GPUs held now"), ("maxJobs", "jobs", "jobs active now"),
                ("gpuHoursPerMonth", "gpuHours", "GPU-hours this month"), ("spendPerMonth", "spend", "spend this month"))


def quota_lines(obj: dict[str, Any]) -> list[str]:
    """A Quota's limits against what it counts (status.used), one row per limit it sets."""
    spec, used = obj.get("spec") or {}, (obj.get("status") or {}).get("used") or {}
    rows = [[key, str(used.get(field, "-")), str(spec[key]), what + (f" ({spec.get('currency', 'USD')})"
                                                                      if key == "spendPerMonth" else "")]
            for key, field, what in QUOTA_LIMITS if spec.get(key) is not None]
    return ["Limits:", *("  " + line for line in format_rows(["LIMIT", "USED", "OF", "COUNTS"], rows).splitlines())]


def metric_lines(metrics: dict[str, Any]) -> list[str]:
    """A job's metrics as the server reads them from every report (GET .../metrics: `totals` and the
    newest `series` point, exact): never from a window of them, so a run of any length reads true."""
    totals, points = metrics.get("totals") or {}, (metrics.get("series") or {}).get("points") or []
    if totals.get("step") is None:
        return ["no reports yet"]
    newest = points[-1] if points else {}

    def mean(key: str) -> str:
        return f"{newest[key]['mean']:.4g}" if newest.get(key) else "-"

    wall = float(totals.get("wallSeconds") or 0.0)
    return [f"step:          {totals['step']} (attempt {totals.get('attempt')}, {totals.get('workers')} workers)",
            f"tokens:        {totals.get('tokens')}",
            f"trainLoss:     {mean('trainLoss')}",
            f"tokensPerSec:  {mean('tokensPerSecond')}",
            f"trainingTime:  {wall:.0f} s",
            f"wanBytes:      {float(totals.get('wanBytes') or 0):.0f} ({float(totals.get('wanBytes') or 0) / 1e9:.3f} GB)"]


def _subtask_row(t: dict[str, Any]) -> list[str]:
    spec, st = t.get("spec") or t, t.get("status") or t
    return [str(dig(t, "metadata.name")), *(scalar(spec.get(k, "-")) for k in ("attempt", "site", "cluster", "gpus")),
            scalar(st.get("phase", "-")), scalar(st.get("launches", "-")), ",".join(st.get("devices") or []) or "-"]


def scalar(value: Any) -> str:
    """A value as YAML writes it: true/false, not Python's True/False."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _nested(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if v is None or v == [] or v == {} or k in INTERNAL:
                continue
            key = to_camel(k) if "_" in k else k
            if isinstance(v, dict | list):
                inner = _nested(v, indent + 2)
                out.extend([f"{pad}{key}:", *inner] if inner else [])
            else:
                out.append(f"{pad}{key}: {scalar(v)}")
    elif isinstance(value, list):
        for v in value:
            if isinstance(v, dict):
                sub = _nested(v, indent + 2)
                if sub:
                    sub[0] = pad + "- " + sub[0].lstrip()
                out.extend(sub)
            else:
                out.append(f"{pad}- {scalar(v)}")
    return out
