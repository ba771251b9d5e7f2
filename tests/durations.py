"""Record how long each test took, for the `slow` marker: `python -m tests.durations REPORT.xml...`.

Reads pytest JUnit reports (`--junitxml`, setup + call + teardown per test) and writes
`tests/durations.json`: every test that took at least RECORD_SECONDS, in seconds. `tests/conftest.py`
marks `slow` each test recorded at SLOW_SECONDS or more, beside the tests whose fixtures start processes,
so that `pytest -m "not slow"` (the pre-commit run) stays within minutes as tests are added. Record again
after adding slow tests (CI prints the slowest of each run); a test not recorded counts as fast.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

FILE = Path(__file__).with_name("durations.json")
RECORD_SECONDS = 0.5


def node_id(classname: str, name: str) -> str:
    """`tests.api.test_x.TestC` + `test_y[p]` → `tests/api/test_x.py::TestC::test_y[p]`."""
    parts = classname.split(".")
    module = next(i for i, p in enumerate(parts) if p.startswith("test_") or i == len(parts) - 1)
    return "::".join(["/".join(parts[: module + 1]) + ".py", *parts[module + 1:], name])


def read(reports: list[Path]) -> dict[str, float]:
    out: dict[str, float] = {}
    for report in reports:
        for case in ET.parse(report).iter("testcase"):
            if case.find("skipped") is not None:
                continue
            nid = node_id(case.get("classname", ""), case.get("name", ""))
            out[nid] = max(out.get(nid, 0.0), float(case.get("time") or 0))
    return out


def load() -> dict[str, float]:
    return json.loads(FILE.read_text()) if FILE.exists() else {}


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.durations REPORT.xml... (pytest --junitxml reports)", file=sys.stderr)
        return 1
    found = read([Path(a) for a in argv])
    kept = {**load(), **{k: round(v, 1) for k, v in found.items()}}
    kept = {k: v for k, v in sorted(kept.items()) if v >= RECORD_SECONDS}
    FILE.write_text(json.dumps(kept, indent=0, sort_keys=True) + "\n")
    print(f"{len(found)} tests read, {len(kept)} recorded at {RECORD_SECONDS} s or more in {FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
