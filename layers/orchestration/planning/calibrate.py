"""Predicted vs measured: the compute model against `cpn bench training` runs on this machine.

    python -m layers.orchestration.planning.calibrate docs/benchmarks/training-wan.json

Reads a training benchmark's JSON, predicts each strategy's run with :func:`perf.predict` on the
same placement (local CPU slots, the same WAN rate) and writes docs/benchmarks/calibration.md: name
every scenario to keep (the file is rewritten from the ones given; its hand-written part stays).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

from layers.orchestration.planning import perf
from layers.orchestration.planning.calibration import CPU_TFLOPS, local_slot_offer
from layers.orchestration.planning.types import Assignment, JobRequirements, ModelShape, WanLink

TINY = ModelShape(parameters=132_864, layers=2, hidden=64, seq_len=128)
KNOBS = ("inner_steps", "compression", "overlap")
KEPT = "## cpn demo"  # calibration.md from this heading on is written by hand and kept  # left unset by the bench: the runtime's autotune decides


def _strategy(row: dict) -> tuple[str, str | None]:
    """The strategy a result row ran and its WAN compression: `auto` rows say what they resolved to."""
    name = row["strategy"]
    if name == "auto" and row.get("resolved"):
        name = row["resolved"].split(",")[0].strip()
    base, *extras = name.split("+")
    return base, next((e for e in extras if e in ("int8", "fp16", "bf16")), None)


def compare(bench: dict) -> list[dict]:
    """Each row's measured wall time and WAN bytes next to what the compute model predicts for the same
    placement, priced as the runtime ran it (unset knobs through the same autotune)."""
    opts = bench["options"]
    sites, workers = int(opts["sites"]), int(opts["workers_per_site"])
    mbps = float(opts.get("wan_mbps") or 10_000)
    # the bench runs every site's workers on this one machine: they share its cores while they compute
    # (perf.host_stretch); a --slow-site sleeps (slowdown − 1)× its compute: to the planner, a slower GPU
    cores = float(bench.get("machine", {}).get("cpus") or sites * workers)
    slow, slowdown = opts.get("slow_site"), float(opts.get("slowdown") or 1.0)
    offers = {f"c{i}": replace(local_slot_offer(f"c{i}", f"s{i}", workers),
                               tflops=CPU_TFLOPS / (slowdown if i == slow else 1.0))
              for i in range(sites)}
    links = [WanLink(f"s{i}", f"s{j}", mbps / 1000, 0.0, Decimal("0")) for i in range(sites) for j in range(i + 1, sites)]
    rows = []
    for r in bench["results"]:
        strategy, compression = _strategy(r)
        set_knobs = {"inner_steps": opts.get("inner_steps"), "compression": compression,
                     "overlap": True if "overlap" in r["strategy"] else None}
        req = JobRequirements(model=TINY, tokens=int(opts["tokens"]), global_batch_tokens=int(opts["global_batch"]),
                              strategy=strategy, staleness=int(opts.get("staleness") or 4),
                              **{k: v for k, v in set_knobs.items() if v is not None},
                              autotuned=frozenset(k for k, v in set_knobs.items() if v is None))
        assignments = [Assignment(f"c{i}", f"s{i}", workers, "CPU") for i in range(sites)]
        ran = offers
        if slowdown > 1 and "balanced shares" not in (r.get("resolved") or ""):
            # equal shares: every rank waits for the slow site each step, as if every slot were that slow
            # (its sleep holds no core, so the compute phase's sharing is the same: processor sharing)
            ran = {c: replace(o, tflops=CPU_TFLOPS / slowdown) for c, o in offers.items()}
        pred = perf.predict(req, assignments, strategy, ran, links, host_cores=cores)
        train_s = pred.total_seconds - pred.startup_seconds  # the bench times training, not an agent's start-up
        rows.append({"strategy": r["strategy"], "ran": r.get("resolved") or strategy,
                     "predicted_s": train_s, "measured_s": r["wall_seconds"], "ratio": r["wall_seconds"] / train_s,
                     "predicted_wan_mb": pred.wan_bytes / 1e6, "measured_wan_mb": r["wan_bytes"] / 1e6})
    return rows


def main(paths: list[str]) -> None:
    out = ["# Compute model calibration: predicted vs measured wall time and WAN bytes", "",
           "`python -m layers.orchestration.planning.calibrate " + " ".join(paths) + "`", "",
           "Measured = wall seconds and WAN bytes of `cpn bench training` on this 2-core machine; predicted = "
           "`perf.predict` for the same placement (CPU slots, same WAN rate, the knobs the runtime resolved, "
           "a `--slow-site` as a slot `--slowdown`× slower, `host_cores` = the machine's cores: the slots' "
           "compute phase shares them, communication and waits do not), without the agents' start-up (the "
           "bench starts no agent). Ratio = measured / predicted; the target is 0.75–1.33.", ""]
    for path in paths:
        bench = json.loads(Path(path).read_text())
        machine = bench.get("machine", {})
        when = f" (run {machine['when']}" + (f", load {machine['load']}" if machine.get("load") else "") + ")" \
            if machine.get("when") else ""
        out += [f"## {bench['scenario']}", "", f"`{bench['command']}`{when}", "",
                "| strategy (as run) | predicted s | measured s | ratio | predicted WAN MB | measured WAN MB |",
                "|---|---:|---:|---:|---:|---:|"]
        for row in compare(bench):
            out.append(f"| {row['strategy']} ({row['ran']}) | {row['predicted_s']:.1f} | {row['measured_s']:.1f} | "
                       f"{row['ratio']:.2f} | {row['predicted_wan_mb']:.2f} | {row['measured_wan_mb']:.2f} |")
        out.append("")
    target = Path("docs/benchmarks/calibration.md")
    kept = target.read_text().partition(KEPT)[1:] if target.exists() else ()
    target.write_text("\n".join(out) + ("\n" + "".join(kept) if kept else ""))  # hand-written sections stay
    print("\n".join(out))


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m layers.orchestration.planning.calibrate",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("benches", nargs="+", metavar="BENCH.json", help="`cpn bench training` JSON files, every one to keep")
    args = parser.parse_args(argv)
    missing = [p for p in args.benches if not Path(p).is_file()]
    if missing:
        parser.error(f"no such benchmark file: {', '.join(missing)}")
    main(args.benches)
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
