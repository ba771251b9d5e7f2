"""Predicted vs measured: the compute model against `cpn bench training` runs on this machine.

    python -m layers.orchestration.planning.calibrate docs/benchmarks/training-wan.json

Reads a training benchmark's JSON, predicts each strategy's run with :func:`perf.predict` on the
same placement (local CPU slots, the same WAN rate) and writes docs/benchmarks/calibration.md.
"""

from __future__ import annotations

import json
import sys
from decimal import Decimal
from pathlib import Path

from layers.orchestration.planning import perf
from layers.orchestration.planning.calibration import local_slot_offer
from layers.orchestration.planning.types import Assignment, JobRequirements, ModelShape, WanLink

TINY = ModelShape(parameters=132_864, layers=2, hidden=64, seq_len=128)
NAMES = {"hierarchical+int8": ("hierarchical", "int8"), "diloco+int8+overlap": ("diloco", "int8")}


def compare(bench: dict) -> list[dict]:
    opts = bench["options"]
    sites, workers = int(opts["sites"]), int(opts["workers_per_site"])
    mbps = float(opts.get("wan_mbps") or 10_000)
    offers = {f"c{i}": local_slot_offer(f"c{i}", f"s{i}", workers) for i in range(sites)}
    links = [WanLink(f"s{i}", f"s{j}", mbps / 1000, 0.0, Decimal("0")) for i in range(sites) for j in range(i + 1, sites)]
    rows = []
    for r in bench["results"]:
        strategy, compression = NAMES.get(r["strategy"], (r["strategy"], None))
        req = JobRequirements(model=TINY, tokens=int(opts["tokens"]), global_batch_tokens=int(opts["global_batch"]),
                              strategy=strategy, inner_steps=int(opts.get("inner_steps", 20)), compression=compression,
                              overlap="overlap" in r["strategy"])
        assignments = [Assignment(f"c{i}", f"s{i}", workers, "CPU") for i in range(sites)]
        pred = perf.predict(req, assignments, strategy, offers, links)
        steps = max(1, req.tokens // req.global_batch_tokens)
        rows.append({"strategy": r["strategy"], "predicted_step_s": pred.step_seconds,
                     "measured_step_s": r["wall_seconds"] / steps,
                     "ratio": (r["wall_seconds"] / steps) / pred.step_seconds})
    return rows


def main(paths: list[str]) -> None:
    out = ["# Compute model calibration: predicted vs measured step time", "",
           "`python -m layers.orchestration.planning.calibrate " + " ".join(paths) + "`", "",
           "Measured = wall seconds / steps of `cpn bench training` on this 2-core machine; predicted = "
           "`perf.predict` for the same placement (CPU slots, same WAN rate). Ratio = measured / predicted.", ""]
    for path in paths:
        bench = json.loads(Path(path).read_text())
        out += [f"## {bench['scenario']}", "", f"`{bench['command']}`", "",
                "| strategy | predicted s/step | measured s/step | ratio |", "|---|---:|---:|---:|"]
        for row in compare(bench):
            out.append(f"| {row['strategy']} | {row['predicted_step_s']:.4f} | {row['measured_step_s']:.4f} | "
                       f"{row['ratio']:.2f} |")
        out.append("")
    Path("docs/benchmarks/calibration.md").write_text("\n".join(out))
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1:])
