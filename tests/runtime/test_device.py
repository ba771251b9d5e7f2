"""Every place the runtime chooses a device: each strategy trains under a trap for tensors made
without one, and every parameter, gradient, optimiser, outer and error-feedback tensor ends on the
worker's device. The ``cuda`` variants (and the NCCL-inside / Gloo-across all-reduce) run wherever
CUDA is present and skip here with the reason.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from cpn.runtime.config import DeviceConfig, StrategyConfig, TrainConfig
from cpn.runtime.device import HOST, HostStage, autocast, outer_on_host, select_device, uses_bf16
from cpn.runtime.launcher import launch
from cpn.runtime.strategies import STRATEGIES
from cpn.runtime.topology import Topology
from tests.runtime.devicetrap import RUNTIME, DeviceTrap, misplaced, state_tensors

NO_CUDA = "no CUDA device on this machine"


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not _cuda_count():
        pytest.skip(NO_CUDA)
    return request.param


def _topology(device: str) -> Topology:
    """2 sites x 2 workers; on CUDA one rank per GPU inside a site (sites may share GPUs)."""
    return Topology.uniform(2, 2 if device == "cpu" else min(2, _cuda_count()))


def _config(strategy: str, device: str, **knobs: Any) -> TrainConfig:
    compression = "int8" if strategy in ("hierarchical", "diloco") else "none"
    return TrainConfig(
        model="tiny", seq_len=32, global_batch_tokens=512, tokens=512 * 8, val_every=4, val_batches=1,
        strategy=StrategyConfig(name=strategy, inner_steps=2, compression=compression, wan_timeout_seconds=20.0),
        device=DeviceConfig(kind=device, **knobs),
    )


def probe(cfg_json: str) -> dict[str, Any]:
    """One rank: train under the trap, then list what is where."""
    import os

    from cpn.runtime.config import ENV_TRAIN_CONFIG
    from cpn.train import lm
    from cpn.train.api import init

    os.environ[ENV_TRAIN_CONFIG] = cfg_json
    trap = DeviceTrap()
    trap.cover_threads()
    with trap:
        trainer = lm.train(init())  # the built-in LM through the public API: the one training path
        ctx, strategy, step = trainer.ctx, trainer.strategy, trainer.steps
        tensors = state_tensors(ctx, strategy)
    ctx.store.set(f"probe/done/{ctx.rank}", "1")
    if ctx.rank == 0:  # rank 0 hosts the store: leave last
        ctx.store.wait([f"probe/done/{r}" for r in range(ctx.groups.world_size)], timedelta(seconds=60))
    return {"device": str(ctx.device), "backend": ctx.groups.backend, "wan_backend": ctx.groups.wan_backend,
            "step": step, "violations": sorted(set(trap.violations)), "misplaced": misplaced(tensors),
            "checked": len(tensors)}


def _run_probe(cfg: TrainConfig, device: str) -> list[dict[str, Any]]:
    topo = _topology(device)
    results = launch(topo, probe, [cfg.model_dump_json()], capture_output=True, timeout=180, failure_grace=10,
                     start_method="forkserver" if device == "cpu" else "spawn")
    return [r.result for r in results]


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_keeps_its_state_on_the_worker_device(strategy: str, device: str) -> None:
    ranks = _run_probe(_config(strategy, device), device)
    for rank, got in enumerate(ranks):
        want = "cpu" if device == "cpu" else f"cuda:{rank % _topology(device).sites[0].ranks}"
        assert got["device"] == want
        assert got["violations"] == [], f"rank {rank} made tensors without a device at {got['violations']}"
        assert got["misplaced"] == [], got["misplaced"]
        assert got["checked"] > 40  # params, grads, optimiser state at least
        assert got["wan_backend"] == "gloo"
        assert got["backend"] == ("gloo" if device == "cpu" else "nccl")
    # the barrier-free budgets (and ps_backup's, counted over every worker's pushes) let rank 0 take fewer steps
    assert ranks[0]["step"] >= 8 or strategy in ("gossip", "ssp", "async_ps", "ps_backup")


def test_diloco_outer_state_on_the_host_when_asked(device: str) -> None:
    ranks = _run_probe(_config("diloco", device, outer_on_host=True), device)
    assert all(r["misplaced"] == [] and r["violations"] == [] for r in ranks), ranks


def test_the_trap_catches_a_tensor_made_without_a_device() -> None:
    """The probe's guarantee: a factory call in runtime code without ``device`` lands on meta."""
    code = compile("made = torch.zeros(3)\nplaced = torch.zeros(3, device='cpu')", str(Path(RUNTIME) / "fake.py"), "exec")
    scope: dict[str, Any] = {"torch": torch}
    trap = DeviceTrap()
    with trap:
        exec(code, scope)  # noqa: S102 - code attributed to a runtime file on purpose
        torch.zeros(2)  # the test's own call: not the runtime's
        torch.optim.AdamW([torch.nn.Parameter(torch.ones(2, device="cpu"))]).step()  # torch's internals
    assert scope["made"].device.type == "meta" and scope["placed"].device == HOST
    assert trap.violations == ["fake.py:1"]


def test_device_choice_and_precision_on_this_machine() -> None:
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert select_device("cpu", env) == HOST
    if _cuda_count() >= 2:
        assert select_device("auto", env) == torch.device("cuda", 1)
    else:
        assert select_device("auto", env) == HOST
        with pytest.raises(RuntimeError, match="fewer workers per site or set device.kind"):
            select_device("cuda", env)
    assert not uses_bf16(HOST, "auto") and uses_bf16(HOST, "bf16")
    with autocast(HOST, "bf16"):
        assert torch.mm(torch.ones(2, 2, device=HOST), torch.ones(2, 2, device=HOST)).dtype == torch.bfloat16
    assert not outer_on_host(DeviceConfig(), HOST, 10**9)
    assert outer_on_host(DeviceConfig(outer_on_host=True), HOST, 1)
    x = torch.arange(4.0, device=HOST)
    assert HostStage(HOST).out(x) is x  # nothing to stage on the CPU


# ----------------------------------------------------------------------------- CUDA only
def _need_cuda(n: int = 1) -> None:
    if _cuda_count() < n:
        pytest.skip(NO_CUDA if not _cuda_count() else f"needs {n} CUDA devices, this machine has {_cuda_count()}")


@pytest.mark.cuda
def test_model_and_buckets_on_the_gpu() -> None:
    _need_cuda()
    from cpn.runtime.bucketing import make_buckets
    from cpn.runtime.codecs import ErrorFeedback, get_codec
    from cpn.runtime.collectives import _encode_parts
    from cpn.runtime.model import build_model

    gpu = torch.device("cuda", 0)
    model = build_model("tiny", device=gpu)
    cpu = build_model("tiny")
    for (name, p), q in zip(model.named_parameters(), cpu.parameters(), strict=True):
        assert p.device == gpu, name
        torch.testing.assert_close(p.cpu(), q)  # same initial weights on every kind of site
    x = torch.randint(0, 256, (2, 16), device=gpu)
    with autocast(gpu, "auto"):
        model.loss(x, x).backward()
    buckets = make_buckets([p.grad for p in model.parameters()], 2**16)
    assert buckets and all(b.flat.device == gpu for b in buckets)
    ef = ErrorFeedback()
    codec = get_codec("int8")
    flat = torch.nn.functional.pad(buckets[0].flat, (0, -buckets[0].flat.numel() % 256))
    wire = _encode_parts(flat, 1, flat.numel(), codec, ef, "k")
    assert wire.device == gpu and all(r.device == gpu for r in ef.residuals.values())
    stage = HostStage(gpu)
    host = stage.out(wire)
    assert host.device == HOST and host.is_pinned() and torch.equal(stage.to_device(host), wire)


def allreduce_worker(algorithm: str) -> dict[str, Any]:
    from cpn.runtime.collectives import allreduce
    from cpn.runtime.groups import init_groups

    g = init_groups()
    gen = torch.Generator(device="cpu").manual_seed(g.rank)
    mine = [torch.randn(1000, generator=gen, device="cpu"), torch.randn(37, 3, generator=gen, device="cpu")]
    want = [t.clone() for t in mine]
    for t in want:  # torch's own all-reduce of the host copies, over Gloo
        torch.distributed.all_reduce(t, group=g.world)
    on_gpu = [t.to(g.device) for t in mine]
    allreduce(on_gpu, algorithm, g)
    return {"device": str(g.device), "backend": g.backend, "wan": g.wan_backend,
            "close": all(torch.allclose(a.cpu(), b, atol=1e-4) for a, b in zip(on_gpu, want, strict=True))}


@pytest.mark.cuda
@pytest.mark.parametrize("algorithm", ["flat", "hierarchical", "leader"])
def test_nccl_inside_gloo_across_equals_torch(algorithm: str) -> None:
    _need_cuda(2)
    results = launch(Topology.uniform(2, 2), allreduce_worker, [algorithm], capture_output=True, timeout=180)
    for r in results:
        assert r.result["device"].startswith("cuda") and r.result["backend"] == "nccl"
        assert r.result["wan"] == "gloo" and r.result["close"], r.result


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", ["ddp", "diloco"])
def test_a_training_run_on_the_gpus(strategy: str, tmp_path: Path) -> None:
    _need_cuda()
    from cpn.runtime.train import run_local

    cfg = _config(strategy, "cuda").model_copy(update={"tokens": 512 * 40, "val_every": 20})
    summary = run_local(cfg, _topology("cuda"), run_dir=tmp_path, timeout=300)
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0
    assert summary["gpu_seconds"] > 0


def test_bench_gpu_runs_without_cuda_and_says_so(tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from cpn.cli.bench_gpu import bench_gpu_cmd
    from cpn.runtime.bench_gpu import flops_per_token
    from cpn.runtime.model import build_model

    model = build_model("tiny")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert flops_per_token(model, 128) == 6 * (linear + 256 * 64) + 12 * 2 * 64 * 128
    args = ["--presets", "tiny", "--seconds", "0.3", "--size-mb", "1", "--repeats", "2", "--out", str(tmp_path), "--json"]
    result = CliRunner().invoke(bench_gpu_cmd, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["cuda"] == bool(_cuda_count())
    if not _cuda_count():
        assert "no CUDA device found" in report["note"] and report["cudaTests"]["ran"] is False
        assert report["allreduce"][1]["skipped"] == "no CUDA device on this machine"
    gloo = report["allreduce"][0]
    assert gloo["backend"] == "gloo" and gloo["busGbps"] > 0
    row = report["throughput"][0]
    assert row["tokensPerSecond"] > 0 and 0 < row["mfu"] < 1.5 and row["gpuModel"] in report["mfu"]
    assert "| gloo |" in (tmp_path / "gpu.md").read_text()
    bad = CliRunner().invoke(bench_gpu_cmd, ["--presets", "huge"])
    assert bad.exit_code == 2 and "unknown preset(s) ['huge']" in bad.output
