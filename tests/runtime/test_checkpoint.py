"""Checkpoints: atomic files, and resume == an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import torch

from cpn.runtime import checkpoint
from cpn.runtime.config import StrategyConfig, TrainConfig
from cpn.runtime.topology import Topology
from cpn.runtime.train import FINAL_MODEL, run_local


def cfg(**over: object) -> TrainConfig:
    return TrainConfig(
        model="tiny", seq_len=64, global_batch_tokens=1024, tokens=1024 * 40, val_every=20, val_batches=2,
        strategy=StrategyConfig(name="diloco", inner_steps=5, wan_timeout_seconds=8.0, compression="none", balance=False), checkpoint_every=10, **over,
    )


def test_resume_gives_the_same_parameters_as_an_uninterrupted_run(tmp_path: Path) -> None:
    topo = Topology.uniform(2, 1)
    run_local(cfg(checkpoint_dir=str(tmp_path / "a-ckpt")), topo, run_dir=tmp_path / "a", start_method="forkserver", timeout=120)
    run_local(cfg(checkpoint_dir=str(tmp_path / "b-ckpt"), stop_at_step=23), topo, run_dir=tmp_path / "b",
              start_method="forkserver", timeout=120)
    assert checkpoint.latest(tmp_path / "b-ckpt") == {"step": 20, "sites": [0, 1]}
    run_local(cfg(checkpoint_dir=str(tmp_path / "c-ckpt"), resume=str(tmp_path / "b-ckpt")), topo,
              run_dir=tmp_path / "c", start_method="forkserver", timeout=120)
    a = torch.load(tmp_path / "a" / FINAL_MODEL, weights_only=True)
    c = torch.load(tmp_path / "c" / FINAL_MODEL, weights_only=True)
    for name in a:
        torch.testing.assert_close(a[name], c[name], atol=1e-6, rtol=1e-5, msg=name)
    assert checkpoint.latest(tmp_path / "c-ckpt")["step"] == 40


def test_atomic_save_leaves_no_temporary_files(tmp_path: Path) -> None:
    checkpoint.atomic_save({"x": torch.ones(3)}, tmp_path / "step-00000001" / "site0.pt")
    checkpoint.atomic_write_json({"step": 1, "sites": [0]}, tmp_path / checkpoint.LATEST)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["latest.json", "site0.pt", "step-00000001"]
    assert checkpoint.latest(tmp_path) == {"step": 1, "sites": [0]}
    assert checkpoint.latest(tmp_path / "missing") is None


def test_a_site_that_never_writes_holds_rank0_only_briefly_and_latest_never_moves_back(tmp_path: Path,
                                                                                       monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 waits a short grace for a site's file (it had died), then goes on; the step is committed
    without it at the deadline; a newer complete step supersedes an older pending one, which then never
    replaces it; a stale latest.json from an earlier attempt does not block this run's commits."""
    import time

    import torch.distributed as dist

    monkeypatch.setattr(checkpoint, "COMMIT_GRACE_SECONDS", 0.05)
    store = dist.HashStore()
    checkpoint.atomic_write_json({"step": 140, "sites": [0, 1]}, tmp_path / checkpoint.LATEST)  # attempt 1's
    kw = {"is_leader": True, "site_state": {"w": 1}, "store": store, "live_sites": [0, 1]}
    t0 = time.monotonic()
    pending = [checkpoint.save(tmp_path, 10, site=0, is_rank0=True, global_state={}, timeout=0.3, **kw)]
    assert time.monotonic() - t0 < 0.25 and pending[0] is not None  # not waiting for site 1
    checkpoint.poll_commits(pending, store)
    assert len(pending) == 1 and checkpoint.latest(tmp_path)["step"] == 140  # not due yet
    checkpoint.poll_commits(pending, store, wait=True)  # the deadline: committed without site 1
    assert pending == [] and checkpoint.latest(tmp_path) == {"step": 10, "sites": [0]}
    older = checkpoint.save(tmp_path, 20, site=0, is_rank0=True, global_state={}, timeout=30, **kw)
    checkpoint.save(tmp_path, 30, site=1, is_rank0=False, global_state={}, **kw)
    newer = checkpoint.save(tmp_path, 30, site=0, is_rank0=True, global_state={}, **kw)
    pending = [older, newer]
    checkpoint.poll_commits(pending, store)  # 30 is complete: it wins, 20 (still waiting for site 1) is dropped
    assert pending == [] and checkpoint.latest(tmp_path) == {"step": 30, "sites": [0, 1]}
