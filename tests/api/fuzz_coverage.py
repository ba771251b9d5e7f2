"""Which operations of a schemathesis run got at least one 2xx response, read from its HAR report.

    python -m tests.api.fuzz_coverage REPORT_DIR_OR_HAR OPENAPI_JSON

prints the count and the operations that never got one (the measure of how much of the API the fuzz
reached past its refusals)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

METHODS = ("get", "put", "post", "delete", "patch", "head", "options")


def _templates(doc: dict) -> list[tuple[re.Pattern[str], str, str]]:
    """(URL-path regex, METHOD, path template); literal segments win over parameters (fewest params first)."""
    out = []
    for path, ops in doc["paths"].items():
        regex = re.compile("^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(path)) + "$")
        out += [(regex, method.upper(), path) for method in ops if method in METHODS]
    return sorted(out, key=lambda t: t[2].count("{"))


def operation_of(method: str, url: str, templates: list[tuple[re.Pattern[str], str, str]]) -> str | None:
    path = re.sub(r"^[a-z]+://[^/]+", "", url).partition("?")[0]
    return next((f"{method} {template}" for regex, m, template in templates
                 if m == method and regex.match(path)), None)


def har_file(report: Path) -> Path:
    return report if report.is_file() else max(report.glob("har-*.json"))


def statuses(report: Path, doc: dict) -> dict[str, set[int]]:
    """Every documented operation → the statuses its requests got (empty: never requested)."""
    templates = _templates(doc)
    seen: dict[str, set[int]] = {f"{m} {p}": set() for _, m, p in templates}
    for entry in json.loads(har_file(report).read_text())["log"]["entries"]:
        op = operation_of(entry["request"]["method"], entry["request"]["url"], templates)
        if op is not None:
            seen[op].add(entry["response"]["status"])
    return seen


def with_2xx(report: Path, doc: dict) -> set[str]:
    return {op for op, got in statuses(report, doc).items() if any(200 <= s < 300 for s in got)}


def main(argv: list[str]) -> None:
    doc = json.loads(Path(argv[1]).read_text())
    seen = statuses(Path(argv[0]), doc)
    ok = {op for op, got in seen.items() if any(200 <= s < 300 for s in got)}
    print(f"{len(ok)}/{len(seen)} operations got a 2xx")
    for op in sorted(set(seen) - ok):
        print(f"  no 2xx: {op}  {sorted(seen[op])}")


if __name__ == "__main__":
    main(sys.argv[1:])
