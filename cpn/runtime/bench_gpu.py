"""``cpn bench gpu``: a short self-check of a machine's devices for CPN training (see ``docs/gpus.md``).

It reports the CUDA devices found, the all-reduce bus bandwidth on the box (NCCL on device
tensors, Gloo on host tensors), training tokens/s of the model presets (bf16 autocast on GPUs that
support it), the model-FLOPs utilisation that implies per GPU model -- the compute model's
calibration input -- and whether the ``cuda``-marked tests pass. Without a CUDA device it says so
and measures the CPU path (one core, fp32: one local-driver slot), so the output is never empty.

MFU = achieved FLOP/s / peak, with training FLOPs per token = 6 * (matmul parameters) + 12 *
layers * d_model * seq_len (PaLM's count, attention included). Peaks come from the caller (the CLI
takes them from the resource layer's GPU catalogue), so the runtime keeps no copy of them.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import torch

from cpn.runtime.device import HOST, autocast, cuda_devices, synchronize, uses_bf16
from cpn.runtime.model import PRESETS, TransformerLM, build_model

__all__ = ["GpuBenchOptions", "Peak", "flops_per_token", "run_gpu_bench"]

Peak = Callable[[str], tuple[str, float] | None]
"""Device name (``NVIDIA H100 80GB HBM3``, or ``CPU``) -> (catalogue model, peak TFLOP/s per device)."""
NO_CUDA = "no CUDA device found on this machine: measured the CPU path instead (one core, fp32, one local slot)"
CUDA_TESTS = Path(__file__).resolve().parents[2] / "tests" / "runtime" / "test_device.py"


@dataclass(kw_only=True)
class GpuBenchOptions:
    presets: list[str] | None = None  # default: every preset on a GPU, tiny and small on the CPU
    seconds: float = 5.0  # measuring time per preset, after warm-up
    size_mb: float = 64.0  # all-reduce message
    repeats: int = 5
    run_tests: bool = True

    def __post_init__(self) -> None:
        unknown = sorted(set(self.presets or []) - set(PRESETS))
        if unknown:
            raise ValueError(f"unknown preset(s) {unknown}: pick from {sorted(PRESETS)}")
        if self.seconds <= 0 or self.size_mb <= 0 or self.repeats < 1:
            raise ValueError("--seconds and --size-mb must be positive and --repeats at least 1")


def devices() -> list[dict[str, Any]]:
    out = []
    for i in range(cuda_devices()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "memoryGb": round(p.total_memory / 2**30, 1),
                    "capability": f"{p.major}.{p.minor}", "bf16": torch.cuda.is_bf16_supported()})
    return out


def flops_per_token(model: TransformerLM, seq_len: int) -> float:
    cfg = model.cfg
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    if cfg.tie_embeddings:
        matmul += cfg.vocab_size * cfg.d_model  # the tied output projection (an untied one is a Linear)
    return 6.0 * matmul + 12.0 * cfg.n_layers * cfg.d_model * seq_len


def _batch(device: torch.device, preset: str) -> tuple[int, int]:
    cfg = PRESETS[preset]
    if device.type == "cpu":
        return 8, min(128, cfg.max_seq_len)
    return 16, min(1024, cfg.max_seq_len)


def tokens_per_second(preset: str, device: torch.device, seconds: float) -> dict[str, Any]:
    """AdamW training steps on random tokens for ``seconds``; tokens/s and achieved TFLOP/s."""
    batch, seq = _batch(device, preset)
    model = build_model(preset, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    precision = "auto" if device.type == "cuda" else "fp32"
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randint(0, model.cfg.vocab_size, (batch, seq + 1), generator=gen, device="cpu").to(device)

    def step() -> None:
        with autocast(device, precision):
            loss = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    synchronize(device)
    steps, t0 = 0, time.perf_counter()
    while steps < 3 or time.perf_counter() - t0 < seconds:
        step()
        steps += 1
        synchronize(device)
    elapsed = time.perf_counter() - t0
    tps = steps * batch * seq / elapsed
    return {"preset": preset, "params": sum(p.numel() for p in model.parameters()), "batch": batch, "seqLen": seq,
            "precision": "bf16" if uses_bf16(device, precision) else "fp32", "steps": steps,
            "tokensPerSecond": round(tps, 1), "tflops": round(tps * flops_per_token(model, seq) / 1e12, 4)}


def _allreduce_worker(size: int, repeats: int, backend: str) -> dict[str, Any] | None:
    import torch.distributed as dist

    from cpn.runtime.groups import init_groups, shutdown

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else HOST
    g = init_groups(device=device)
    buf = torch.ones(size // 4, device=device)
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        synchronize(device)
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=g.world)
        synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    shutdown()
    return {"seconds": statistics.median(times)} if g.rank == 0 else None


def allreduce_bandwidth(backend: str, ranks: int, size_mb: float, repeats: int) -> dict[str, Any]:
    """Median all-reduce time of ``size_mb`` over ``ranks`` local processes; bus bandwidth as
    nccl-tests counts it (2(n-1)/n of the buffer per rank)."""
    from cpn.runtime.launcher import launch
    from cpn.runtime.topology import Topology

    row: dict[str, Any] = {"backend": backend, "ranks": ranks, "tensors": "cuda" if backend == "nccl" else "cpu",
                           "sizeMb": size_mb}
    if ranks < 2:
        return {**row, "skipped": f"{backend} all-reduce needs 2 ranks; this machine gives {ranks}"}
    size = int(size_mb * 2**20) // 4 * 4
    results = launch(Topology.single_site(ranks), _allreduce_worker, [size, repeats, backend],
                     capture_output=True, timeout=600)
    seconds = results[0].result["seconds"]
    return {**row, "seconds": round(seconds, 5),
            "busGbps": round(2 * (ranks - 1) / ranks * size * 8 / seconds / 1e9, 3)}


def cuda_tests() -> dict[str, Any]:
    if not cuda_devices():
        return {"ran": False, "reason": "no CUDA device on this machine"}
    if not CUDA_TESTS.exists():
        return {"ran": False, "reason": f"{CUDA_TESTS} is not here (an installed package): run from a checkout"}
    return run_tests(CUDA_TESTS, cwd=CUDA_TESTS.parents[2])


def run_tests(path: Path, *, cwd: Path, marker: str = "cuda") -> dict[str, Any]:
    """Run the `marker` tests of `path`; ``passed`` only when every one ran and passed: a test that
    skipped (say, the 2-GPU NCCL test on a one-GPU machine) is listed under ``skipped``, not passed."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker,
                               f"--junitxml={junit}", str(path)], capture_output=True, text=True, cwd=cwd)
        cases = _junit_cases(junit)
    lines = proc.stdout.strip().splitlines()
    counts = {k: sum(1 for c in cases if c["outcome"] == k) for k in ("passed", "failed", "skipped")}
    skipped = [{"test": c["test"], "reason": c["reason"]} for c in cases if c["outcome"] == "skipped"]
    return {"ran": True, "passed": proc.returncode == 0 and counts["passed"] > 0 and not skipped,
            "counts": counts, "skipped": skipped, "summary": lines[-1] if lines else proc.stderr[-300:]}


def _junit_cases(path: Path) -> list[dict[str, str]]:
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return []
    cases = []
    for case in root.iter("testcase"):
        skip = case.find("skipped")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        outcome = "skipped" if skip is not None else "failed" if bad is not None else "passed"
        cases.append({"test": f"{case.get('classname')}.{case.get('name')}", "outcome": outcome,
                      "reason": (skip.get("message") or "") if skip is not None else ""})
    return cases


def _throughput(opts: GpuBenchOptions, peak: Peak) -> list[dict[str, Any]]:
    """Every preset on one device of each GPU model (or on one CPU core)."""
    targets: dict[str, torch.device] = {}
    for d in devices():
        targets.setdefault(d["name"], torch.device("cuda", d["index"]))
    if not targets:
        targets["CPU"] = HOST
    rows = []
    threads = torch.get_num_threads()
    for name, device in targets.items():
        known = peak(name)
        if device.type == "cpu":
            torch.set_num_threads(1)
        small = [p for p in PRESETS if PRESETS[p].parameters < 200e6]  # not the real-size shapes
        presets = opts.presets or (sorted(small, key=lambda p: PRESETS[p].d_model) if device.type == "cuda"
                                   else ["tiny", "small"])
        for preset in presets:
            row = {"device": name, "gpuModel": known[0] if known else None}
            try:
                row.update(tokens_per_second(preset, device, opts.seconds))
            except torch.OutOfMemoryError:
                rows.append({**row, "preset": preset, "skipped": "out of device memory"})
                continue
            if known:
                row.update(peakTflops=known[1], mfu=round(row["tflops"] / known[1], 4))
            rows.append(row)
        torch.set_num_threads(threads)
    return rows


def run_gpu_bench(opts: GpuBenchOptions, peak: Peak) -> dict[str, Any]:
    found = devices()
    gpus = len(found)
    throughput = _throughput(opts, peak)
    mfu: dict[str, float] = {}
    for model in {r["gpuModel"] for r in throughput if r.get("mfu") is not None}:
        mfu[model] = round(statistics.mean(r["mfu"] for r in throughput if r.get("gpuModel") == model and "mfu" in r), 4)
    allreduce = [allreduce_bandwidth("gloo", max(2, gpus), opts.size_mb, opts.repeats)]
    allreduce.append(allreduce_bandwidth("nccl", gpus, opts.size_mb, opts.repeats) if gpus
                     else {"backend": "nccl", "skipped": "no CUDA device on this machine"})
    return {"cuda": bool(gpus), "note": None if gpus else NO_CUDA, "devices": found,
            "torch": torch.__version__, "allreduce": allreduce, "throughput": throughput, "mfu": mfu,
            "cudaTests": cuda_tests() if opts.run_tests else {"ran": False, "reason": "--no-tests"}}


def markdown(report: dict[str, Any]) -> str:
    lines = ["# GPU self-check (`cpn bench gpu`)", ""]
    if report["note"]:
        lines += [f"**{report['note']}**", ""]
    for d in report["devices"]:
        lines.append(f"- cuda:{d['index']} {d['name']}, {d['memoryGb']} GiB, sm {d['capability']}, bf16 {d['bf16']}")
    lines += ["", "| backend | ranks | tensors | MiB | seconds | bus Gbit/s |", "|---|---:|---|---:|---:|---:|"]
    for r in report["allreduce"]:
        if "skipped" in r:
            lines.append(f"| {r['backend']} | – | – | – | – | {r['skipped']} |")
        else:
            lines.append(f"| {r['backend']} | {r['ranks']} | {r['tensors']} | {r['sizeMb']:g} | {r['seconds']} | {r['busGbps']} |")
    lines += ["", "| device | preset | precision | batch × seq | tokens/s | TFLOP/s | MFU |", "|---|---|---|---|---:|---:|---:|"]
    for r in report["throughput"]:
        if "skipped" in r:
            lines.append(f"| {r['device']} | {r['preset']} | – | – | – | – | {r['skipped']} |")
            continue
        mfu = f"{r['mfu']:.3f}" if r.get("mfu") is not None else "–"
        lines.append(f"| {r['device']} | {r['preset']} | {r['precision']} | {r['batch']} × {r['seqLen']} | "
                     f"{r['tokensPerSecond']:,.0f} | {r['tflops']:.3f} | {mfu} |")
    tests = report["cudaTests"]
    lines += ["", f"MFU per GPU model: {report['mfu'] or '–'}. CUDA tests: "
              + (tests["summary"] if tests.get("ran") else f"not run ({tests['reason']})"), ""]
    lines += [f"- skipped, not passed: {t['test']}: {t['reason']}" for t in tests.get("skipped", [])]
    return "\n".join(lines)
