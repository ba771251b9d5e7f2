"""Benchmark the all-reduce algorithms on S x W local processes behind an emulated WAN.

Each (algorithm, size) is timed as the median over ``repeats`` runs (after ``warmup``) of the
slowest rank's time; bytes come three ways — the algorithm's own count, this rank's TCP sockets and
the site veths' counters — and every row carries the alpha-beta prediction and the WAN lower bound
2(S-1)/S * size / B.  :func:`write_reports` leaves JSON, a markdown table and a PNG chart.

With ``regions`` the S sites form that many regions of S/regions sites (:meth:`Topology.regional`):
every pair of sites gets its own emulated link, ``metro_mbps`` inside a region and ``wan_mbps``
(long-haul) between regions, and no site uplink; predictions then use
:func:`cpn.runtime.costmodel.predict_multilevel_seconds` for ``multilevel`` and the slowest link for
the others (their rings cross a long-haul link at every step).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cpn.runtime.costmodel import CostParams, lower_bound_seconds, predict_multilevel_seconds, predict_seconds
from cpn.runtime.launcher import launch
from cpn.runtime.topology import Topology

__all__ = ["BenchConfig", "bench_worker", "run_bench", "write_reports"]

MIB = 2**20


@dataclass(kw_only=True)
class BenchConfig:
    """One benchmark run; ``sites`` may list several S, each launched separately."""

    sites: list[int] = field(default_factory=lambda: [2])
    workers_per_site: int = 2
    sizes_mb: list[float] = field(default_factory=lambda: [1.0, 16.0, 64.0])
    wan_mbps: float | None = 100.0
    algorithms: list[str] = field(default_factory=lambda: ["flat", "hierarchical", "leader"])
    repeats: int = 5
    warmup: int = 1
    bucket_mb: float = 25.0
    chunk_mb: float = 4.0
    rtt_ms: float = 0.0
    regions: int | None = None
    metro_mbps: float | None = None

    def __post_init__(self) -> None:
        from cpn.runtime.collectives import parse_algorithm

        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("need --repeats >= 1 and --warmup >= 0 (the issue asks for >= 5 repeats)")
        if any(s < 1 for s in self.sites) or self.workers_per_site < 1:
            raise ValueError("--sites and --workers-per-site must be positive")
        if any(mb <= 0 for mb in self.sizes_mb):
            raise ValueError("--sizes-mb must be positive sizes in MiB, e.g. 1,16,64")
        for spec in self.algorithms:
            parse_algorithm(spec)
        if self.regions is not None:
            if self.regions < 1 or any(s % self.regions for s in self.sites):
                raise ValueError(
                    f"--regions {self.regions} must divide every --sites value {self.sites} "
                    "(the sites split evenly into regions)"
                )
        elif self.metro_mbps is not None:
            raise ValueError("--metro-mbps needs --regions (metro links join the sites of one region)")

    def topology(self, sites: int) -> Topology:
        if self.regions is None:
            return Topology.uniform(sites, self.workers_per_site)
        return Topology.regional(
            self.regions, sites // self.regions, self.workers_per_site, self.metro_mbps, self.wan_mbps
        )


# ----------------------------------------------------------------------------- worker side
def _time_case(spec: str, orig: Any, cfg: BenchConfig) -> dict[str, Any]:
    import torch.distributed as dist

    from cpn.runtime.accounting import Meter
    from cpn.runtime.collectives import allreduce

    buf = orig.clone()
    sizes = {"bucket_bytes": int(cfg.bucket_mb * MIB), "chunk_bytes": int(cfg.chunk_mb * MIB)}
    for _ in range(cfg.warmup):
        buf.copy_(orig)
        allreduce(buf, algorithm=spec, **sizes)
    meter = Meter()
    meter.start()
    dist.barrier()
    times, stats = [], None
    for _ in range(cfg.repeats):
        buf.copy_(orig)
        dist.barrier()
        stats = allreduce(buf, algorithm=spec, **sizes)
        times.append(stats.seconds)
    dist.barrier()
    sockets, iface = meter.stop()
    return {
        "times": times,
        "intra": stats.intra_bytes,
        "wan": stats.wan_bytes,
        "metro": stats.metro_bytes,
        "sock": sockets,
        "iface": iface,
    }


def _merge(spec: str, size: int, per_rank: list[dict[str, Any]], local: list[int], cfg: BenchConfig) -> dict:
    reps = cfg.repeats
    slowest = [max(r["times"][i] for r in per_rank) for i in range(reps)]
    leaders = [r for r, lr in zip(per_rank, local, strict=True) if lr == 0 and r["iface"] is not None]
    return {
        "algorithm": spec,
        "size_bytes": size,
        "seconds": statistics.median(slowest),
        "seconds_all": slowest,
        "wan_bytes": sum(r["wan"] for r in per_rank),
        "metro_bytes": sum(r["metro"] for r in per_rank),
        "intra_bytes": sum(r["intra"] for r in per_rank),
        "measured_wan_bytes": round(sum(r["sock"].wan for r in per_rank) / reps),
        "measured_intra_bytes": round(sum(r["sock"].intra for r in per_rank) / reps),
        "iface_wan_bytes": round(sum(r["iface"] for r in leaders) / reps) if leaders else None,
    }


def bench_worker(cfg: BenchConfig) -> list[dict[str, Any]] | None:
    """Runs on every rank; rank 0 returns the rows (without bounds and predictions)."""
    import torch
    import torch.distributed as dist

    from cpn.runtime.groups import init_groups, shutdown

    g = init_groups()
    rows = []
    for mb in cfg.sizes_mb:
        size = int(mb * MIB) // 4 * 4
        host = torch.randn(size // 4, generator=torch.Generator().manual_seed(g.rank), device="cpu")
        orig = host.to(g.device)
        for spec in cfg.algorithms:
            mine = _time_case(spec, orig, cfg)
            gathered: list[Any] = [None] * g.world_size
            dist.all_gather_object(gathered, mine)
            if g.rank == 0:
                local = [g.topology.local_rank(r) for r in range(g.world_size)]
                rows.append(_merge(spec, size, gathered, local, cfg))
        del orig
    shutdown()
    return rows if g.rank == 0 else None


# ----------------------------------------------------------------------------- driver
def _annotate(row: dict[str, Any], sites: int, cfg: BenchConfig) -> dict[str, Any]:
    from cpn.runtime.collectives import parse_algorithm

    alg, comp = parse_algorithm(row["algorithm"])
    w, b = cfg.workers_per_site, cfg.wan_mbps
    params = CostParams(rtt_ms=cfg.rtt_ms)
    chunk = cfg.chunk_mb * MIB
    if cfg.regions is None:
        bound = lower_bound_seconds(row["size_bytes"], sites, b) if b and sites > 1 else None
        predicted = predict_seconds(alg, row["size_bytes"], sites, w, b, comp, params, chunk) if b else None
    else:
        bound = None  # the uplink bound does not apply to per-pair links
        predicted = _predict_regional(alg, comp, row["size_bytes"], sites, cfg, params, chunk)
    return {
        **row,
        "sites": sites,
        "regions": cfg.regions,
        "workers_per_site": w,
        "wan_mbps": b,
        "metro_mbps": cfg.metro_mbps,
        "lower_bound_seconds": bound,
        "efficiency": bound / row["seconds"] if bound else None,
        "predicted_seconds": predicted,
    }


def _predict_regional(
    alg: str, comp: str | None, size: int, sites: int, cfg: BenchConfig, params: CostParams, chunk: float
) -> float | None:
    regions = cfg.regions or 1
    rates = [x for x in (cfg.metro_mbps, cfg.wan_mbps) if x]
    if not rates:
        return None
    if alg == "multilevel":
        from cpn.runtime.collectives import level_codecs

        codecs = level_codecs(comp)
        names = {k: c.name if c else None for k, c in codecs.items()}
        metro_c = names.get("metro") or (names.get("top") if regions == 1 else None)
        wan_c = names.get("wan") or (names.get("top") if regions > 1 else None)
        wan = cfg.wan_mbps if regions > 1 else (cfg.metro_mbps or cfg.wan_mbps)
        return predict_multilevel_seconds(
            size, cfg.workers_per_site, sites // regions, regions, cfg.metro_mbps, wan or min(rates),
            metro_c, wan_c, params, chunk,
        )
    slowest = cfg.wan_mbps if regions > 1 and cfg.wan_mbps else min(rates)
    return predict_seconds(alg, size, sites, cfg.workers_per_site, slowest, comp, params, chunk)


def _timeout(cfg: BenchConfig, sites: int) -> float:
    """Generous: ten times the flat prediction per case, plus process start-up."""
    per_case = sum(
        predict_seconds("flat", mb * MIB, sites, cfg.workers_per_site, cfg.wan_mbps or cfg.metro_mbps or 1000.0)
        for mb in cfg.sizes_mb
    )
    return 300 + 10 * per_case * len(cfg.algorithms) * (cfg.repeats + cfg.warmup)


def run_bench(cfg: BenchConfig) -> list[dict[str, Any]]:
    """Launch one job per S and return every row, annotated with bound, efficiency and prediction."""
    rows = []
    for sites in cfg.sites:
        topo = cfg.topology(sites)
        shaped = sites > 1 and bool(cfg.wan_mbps or cfg.metro_mbps)
        results = launch(
            topo,
            bench_worker,
            (cfg,),
            wan_mbps=cfg.wan_mbps if sites > 1 and cfg.regions is None else None,
            timeout=_timeout(cfg, sites),
            capture_output=True,
            emulate_wan=shaped if cfg.regions is not None else None,
        )
        rows += [_annotate(r, sites, cfg) for r in results[0].result]
    return rows


# ----------------------------------------------------------------------------- reports
def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def _table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| S | algorithm | size MiB | seconds | predicted s | lower bound s | efficiency "
        "| WAN bytes (algorithm) | WAN bytes (sockets) | WAN bytes (veths) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['sites']} | {r['algorithm']} | {r['size_bytes'] / MIB:g} | {r['seconds']:.3f} "
            f"| {_fmt(r['predicted_seconds'])} | {_fmt(r['lower_bound_seconds'])} | {_fmt(r['efficiency'], '.2f')} "
            f"| {r['wan_bytes']:,} | {r['measured_wan_bytes']:,} | {_fmt(r['iface_wan_bytes'], ',')} |"
        )
    return out


def _regional_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| S | regions | algorithm | size MiB | seconds | predicted s | measured / predicted "
        "| metro bytes (algorithm) | long-haul bytes (algorithm) | inter-site bytes (sockets) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        metro = r.get("metro_bytes") or 0
        out.append(
            f"| {r['sites']} | {r['regions']} | {r['algorithm']} | {r['size_bytes'] / MIB:g} | {r['seconds']:.3f} "
            f"| {_fmt(r['predicted_seconds'])} | {_fmt(_ratio(r['seconds'], r['predicted_seconds']), '.2f')} "
            f"| {metro:,} | {r['wan_bytes'] - metro:,} | {r['measured_wan_bytes']:,} |"
        )
    return out


def _find(rows: list[dict], sites: int, size: int, alg: str) -> dict | None:
    return next(
        (r for r in rows if (r["sites"], r["size_bytes"], r["algorithm"]) == (sites, size, alg)), None
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Headline comparisons: hierarchical vs flat (measured and predicted), int8 vs plain, the best per size."""
    lines = []
    for sites, size in sorted({(r["sites"], r["size_bytes"]) for r in rows}):
        here = [r for r in rows if (r["sites"], r["size_bytes"]) == (sites, size)]
        tag = f"S={sites}, {size / MIB:g} MiB"
        flat, hier = _find(rows, sites, size, "flat"), _find(rows, sites, size, "hierarchical")
        if flat and hier:
            lines.append(
                f"- {tag}: hierarchical is {_fmt(_ratio(flat['seconds'], hier['seconds']), '.2f')}x faster than flat "
                f"(alpha-beta model predicts {_fmt(_ratio(flat['predicted_seconds'], hier['predicted_seconds']), '.2f')}x)"
            )
        ml = _find(rows, sites, size, "multilevel")
        if ml and hier:
            lines.append(
                f"- {tag}: multilevel is {_fmt(_ratio(hier['seconds'], ml['seconds']), '.2f')}x faster than hierarchical "
                f"(alpha-beta model predicts {_fmt(_ratio(hier['predicted_seconds'], ml['predicted_seconds']), '.2f')}x); "
                f"multilevel took {_fmt(_ratio(ml['seconds'], ml['predicted_seconds']), '.2f')}x its predicted time, "
                f"hierarchical {_fmt(_ratio(hier['seconds'], hier['predicted_seconds']), '.2f')}x"
            )
        for r in here:
            base_name = r["algorithm"].split("+")[0]
            base = _find(rows, sites, size, base_name) if "+" in r["algorithm"] else None
            if base and base["wan_bytes"]:
                lines.append(
                    f"- {tag}: {r['algorithm']} sends {_fmt(_ratio(r['wan_bytes'], base['wan_bytes']), '.3f')}x the WAN "
                    f"bytes and takes {_fmt(_ratio(r['seconds'], base['seconds']), '.2f')}x the time of {base_name}"
                )
        lines += _best(here, tag)
    return lines


def _best(here: list[dict[str, Any]], tag: str) -> list[str]:
    plain = [r for r in here if "+" not in r["algorithm"] and r["efficiency"]]
    packed = [r for r in here if "+" in r["algorithm"] and r["efficiency"]]
    out = []
    if plain:
        b = max(plain, key=lambda r: r["efficiency"])
        out.append(f"- {tag}: highest efficiency uncompressed: **{b['algorithm']}** ({b['efficiency']:.2f})")
    if packed:
        b = max(packed, key=lambda r: r["efficiency"])
        out.append(f"- {tag}: highest efficiency compressed: **{b['algorithm']}** ({b['efficiency']:.2f})")
    return out


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    site_counts = sorted({r["sites"] for r in rows})
    fig, axes = plt.subplots(1, len(site_counts), figsize=(6 * len(site_counts), 4.5), squeeze=False)
    for ax, sites in zip(axes[0], site_counts, strict=True):
        mine = [r for r in rows if r["sites"] == sites]
        for alg in dict.fromkeys(r["algorithm"] for r in mine):
            pts = sorted((r["size_bytes"] / MIB, r["seconds"]) for r in mine if r["algorithm"] == alg)
            ax.plot(*zip(*pts, strict=True), marker="o", label=alg)
        bounds = sorted(
            {(r["size_bytes"] / MIB, r["lower_bound_seconds"]) for r in mine if r["lower_bound_seconds"]}
        )
        if bounds:
            ax.plot(*zip(*bounds, strict=True), "k--", label="WAN lower bound")
        ax.set(
            xscale="log", yscale="log", xlabel="all-reduce size (MiB)", ylabel="seconds", title=f"S={sites}"
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(
    rows: list[dict[str, Any]],
    cfg: BenchConfig,
    command: str,
    out_dir: Path,
    stem: str = "collectives",
    notes: list[str] | None = None,
) -> list[Path]:
    """``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` under ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    paths[0].write_text(
        json.dumps({"command": command, "config": asdict(cfg), "results": rows}, indent=1) + "\n"
    )
    regional = cfg.regions is not None
    setup = (
        [
            f"{cfg.regions} regions; every pair of sites on its own emulated link (htb class per peer): "
            f"metro {_fmt(cfg.metro_mbps, 'g')} Mbit/s inside a region, long-haul {_fmt(cfg.wan_mbps, 'g')} Mbit/s "
            "between regions; bytes are per job (all ranks). Predicted = α-β model "
            "(`cpn.runtime.costmodel.predict_multilevel_seconds` for multilevel; the slowest link for the rest).",
            "",
        ]
        if regional
        else []
    )
    md = [
        "# All-reduce benchmark",
        "",
        *setup,
        f"Made by `{command}` (sizes in MiB, B in Mbit/s, median of {cfg.repeats} runs after {cfg.warmup} warm-up).",
        "Efficiency = lower bound 2(S-1)/S·size/B ÷ measured seconds; predicted = α-β model "
        f"(`cpn.runtime.costmodel`, RTT {cfg.rtt_ms:g} ms). See `docs/runtime-collectives.md` for the discussion.",
        "",
        *(_regional_table(rows) if regional else _table(rows)),
        "",
        *[f"_{n}_" for n in notes or []],
        "",
        "## Summary",
        "",
        *summary(rows),
        "",
        f"![time vs size]({paths[2].name})",
        "",
    ]
    paths[1].write_text("\n".join(md))
    _plot(rows, paths[2], command)
    return paths
