"""hierarchical all-reduces gradient buckets as backward produces them (torch DDP's overlap)."""

from __future__ import annotations

from pathlib import Path

import torch

from cpn.runtime.collectives import DEFAULT_BUCKET_BYTES
from cpn.runtime.config import StrategyConfig, TrainConfig
from cpn.runtime.model import build_model
from cpn.runtime.strategies.hierarchical import FIRST_BUCKET_BYTES, GradBuckets
from cpn.runtime.topology import Topology
from cpn.runtime.train import FINAL_MODEL, run_local


def test_buckets_start_while_backward_is_still_running() -> None:
    model = build_model("tiny", seed=0)
    first = next(model.parameters())  # its gradient comes last (reverse order): the embedding, tied to the head
    seen: list[int] = []
    first.register_post_accumulate_grad_hook(lambda p: seen.append(buckets.next))  # runs before the buckets' hook
    reduced: list[tuple[int, int]] = []
    quarter = sum(p.numel() * p.element_size() for p in model.parameters()) // 4
    buckets = GradBuckets(model, quarter, lambda k, params: reduced.append((k, len(params))))
    assert len(buckets.buckets) >= 3
    assert sorted(id(p) for b in buckets.buckets for p in b) == sorted(id(p) for p in model.parameters())
    x = torch.randint(0, 256, (2, 32))
    model.loss(x, x).backward()
    assert seen and seen[0] >= 1, seen  # an earlier bucket was already on its way when the last gradient came
    buckets.wait()
    assert [k for k, _ in reduced] == list(range(len(buckets.buckets)))  # every bucket once, in order
    buckets.wait()  # a step without backward (a rank with no tokens) still reduces every bucket, in order
    assert [k for k, _ in reduced] == list(range(len(buckets.buckets))) * 2
    buckets.close()


def test_buckets_follow_torch_ddps_caps() -> None:
    """One bucket for a model under 1 MiB (each collective's fixed cost is paid once a step); a larger
    model's first bucket holds at most 1 MiB, so its all-reduce starts early in backward."""
    def sizes(model: torch.nn.Module) -> list[int]:
        buckets = GradBuckets(model, DEFAULT_BUCKET_BYTES, lambda k, params: None, first_bucket_bytes=FIRST_BUCKET_BYTES)
        buckets.close()
        return [sum(p.numel() * p.element_size() for p in b) for b in buckets.buckets]

    assert FIRST_BUCKET_BYTES == 2**20 and len(sizes(build_model("tiny", seed=0))) == 1
    layers = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(8)))  # 8 x 1.0 MiB
    big = sizes(layers)
    assert len(big) == 2 and big[0] <= FIRST_BUCKET_BYTES < big[1] <= DEFAULT_BUCKET_BYTES, big


def hierarchical(hooks: bool) -> TrainConfig:
    return TrainConfig(model="tiny", seq_len=64, global_batch_tokens=1024, tokens=1024 * 12 + 200, val_every=6,
                       val_batches=2, strategy=StrategyConfig(name="hierarchical", balance=False, grad_hooks=hooks,
                                                              compression="none", wan_timeout_seconds=8.0))


def test_bucketed_hooks_give_the_parameters_of_the_post_backward_all_reduce(tmp_path: Path) -> None:
    """12 steps and a trimmed 13th on 2 sites x 2 workers: the same parameters either way (float rounding)."""
    for hooks in (True, False):
        run_local(hierarchical(hooks), Topology.uniform(2, 2), run_dir=tmp_path / str(hooks), timeout=120,
                  start_method="forkserver")
    hooked = torch.load(tmp_path / "True" / FINAL_MODEL, weights_only=True)
    after = torch.load(tmp_path / "False" / FINAL_MODEL, weights_only=True)
    start = build_model("tiny", seed=0).state_dict()
    assert any(not torch.equal(after[k], start[k]) for k in after)  # it trained
    for name in after:
        torch.testing.assert_close(hooked[name], after[name], atol=1e-5, rtol=1e-4, msg=name)
