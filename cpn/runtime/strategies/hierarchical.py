"""``hierarchical``: every step, gradients through the WAN-aware all-reduce (2D torus).

Intra-site reduce-scatter, one cross-site all-reduce per local rank on a 1/W shard (optionally
fp16/bf16/int8 on the WAN with error feedback), intra-site all-gather.

The all-reduce overlaps the backward pass, as torch DDP's does (the seeds' tensor fusion with
overlap): :class:`GradBuckets` cuts the parameters, in reverse order (roughly the order backward
produces their gradients), into buckets; a ``register_post_accumulate_grad_hook`` on each parameter
marks its gradient ready, and a complete bucket's all-reduce starts on a background thread while
backward computes the rest. Buckets start in the same order on every rank (bucket k only after
buckets 0..k-1), so the collectives match. After backward the loop waits for them; that exposed
time is counted as communication. ``strategy.grad_hooks: false`` all-reduces after the whole
backward pass instead (same result up to float rounding; tested).

When the topology spans more than one region (sites labelled with their catalogue region, equal
ranks per site and sites per region) the all-reduce is ``multilevel`` instead: site, then the metro
links of a region, then the long-haul links between regions, so the slow links carry 1/R of what the
two-level ring would (R sites per region). Metro links run uncompressed; the job's compression
applies to the long-haul level only. The run summary names the algorithm (``allreduce``) and
the bytes the ranks sent on metro links (``wan_metro_bytes``, part of ``wan_bytes``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cpn.runtime.codecs import ErrorFeedback, needs_error_feedback
from cpn.runtime.collectives import DEFAULT_BUCKET_BYTES, Stats, allreduce
from cpn.runtime.device import ready_event
from cpn.runtime.strategies.base import Context, grads_of, timed_barrier, weigh
from cpn.runtime.strategies.ddp import DDP
from cpn.runtime.topology import Topology

METRO_KEY = "cpn/hierarchical/metro"  # each rank's metro bytes, for rank 0's summary
# torch DDP's bucket caps: the first bucket (the last layers' gradients, ready first) up to 1 MiB, the
# others up to 25 MiB (collectives.DEFAULT_BUCKET_BYTES). Every collective has a fixed cost beside its
# bytes (a gloo all-reduce among 3 processes here: 2.4 ms and 1.2 ms of CPU per rank, whatever the size
# up to 0.5 MB), so a small model goes in one bucket: `tiny` (0.5 MB) cut in four paid that four times a
# step (docs/benchmarks/training-notes.md, "one bucket").
FIRST_BUCKET_BYTES = dist._DEFAULT_FIRST_BUCKET_BYTES  # noqa: SLF001 - torch DDP's own constant


class GradBuckets:
    """Parameters in buckets whose gradients are reduced by ``reduce(k, params)`` as soon as backward
    has produced all of bucket k's (and every earlier bucket started). The first bucket holds at most
    ``first_bucket_bytes`` (default: ``bucket_bytes``), the others ``bucket_bytes``."""

    def __init__(self, model: nn.Module, bucket_bytes: int, reduce: Callable[[int, list[nn.Parameter]], Any],
                 first_bucket_bytes: int | None = None):
        params = [p for p in model.parameters() if p.requires_grad]
        first = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
        self.buckets: list[list[nn.Parameter]] = []
        size = 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            cap = first if len(self.buckets) == 1 else bucket_bytes
            if not self.buckets or (size + nbytes > cap and self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.reduce = reduce
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="cpn-grad-buckets")
        self._reset()
        self.handles = [p.register_post_accumulate_grad_hook(self._ready) for p in params]

    def _reset(self) -> None:
        self.missing = [len(b) for b in self.buckets]
        self.next = 0
        self.futures: list[Future] = []

    def _ready(self, p: torch.Tensor) -> None:
        self.missing[self.bucket_of[id(p)]] -= 1
        self._launch(ready_event(p.device))

    def _launch(self, event: torch.cuda.Event | None = None) -> None:
        while self.next < len(self.buckets) and self.missing[self.next] <= 0:
            k, self.next = self.next, self.next + 1
            self.futures.append(self.pool.submit(self._run, k, event))

    def _run(self, k: int, event: torch.cuda.Event | None) -> Any:
        if event is not None:  # the gradients are on the device's stream: wait until backward wrote them
            event.synchronize()
        return self.reduce(k, self.buckets[k])

    def wait(self) -> list[Any]:
        """After backward: start what no hook started (parameters without a gradient this step, or a
        rank with no tokens in a trimmed step) and return every bucket's result, in bucket order."""
        self.missing = [0] * len(self.buckets)
        self._launch(ready_event(self.buckets[0][0].device) if self.buckets else None)
        results = [f.result() for f in self.futures]
        self._reset()
        return results

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.pool.shutdown(wait=False)


def allreduce_of(topology: Topology, compression: str | None) -> tuple[str, str | None]:
    """(algorithm, compression) for the gradients: ``multilevel`` with ``none/<compression>`` (metro
    links uncompressed, the long-haul level coded) when the sites span regions, a region holds more
    than one site and the levels are even; ``flat`` (the backend's own ring all-reduce, as ddp's) when
    every site runs one worker: there the two-level split has no intra-site level, moves the same bytes
    and only adds its per-slice staging; else ``hierarchical`` with ``compression`` on its WAN leg
    (with one site per region the two move the same bytes)."""
    if 1 < topology.num_regions < topology.num_sites and topology.is_regular:
        return "multilevel", None if compression is None else f"none/{compression}"
    if all(site.ranks == 1 for site in topology.sites):  # no intra-site level: the two-level split is the ring
        return "flat", compression
    return "hierarchical", compression


class Hierarchical(DDP):
    name = "hierarchical"
    algorithm = "hierarchical"
    balanced = True
    may_idle = True

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        compression = ctx.cfg.strategy.compression
        self._compression = None if compression == "none" else compression
        self.collective, self._wire = allreduce_of(ctx.groups.topology, self._compression)
        self.metro_bytes = 0
        self.ef = ErrorFeedback() if needs_error_feedback(self._compression) else None
        self.grad_buckets = GradBuckets(self.model, DEFAULT_BUCKET_BYTES, self._reduce_bucket,
                                        first_bucket_bytes=FIRST_BUCKET_BYTES) \
            if ctx.cfg.strategy.grad_hooks and not self.sharded else None  # sharded: FSDP reduces in backward
        if self.sharded:
            self.collective = "hsdp"  # reduce-scatter in the site (backward), shard all-reduce across sites

    @property
    def compression(self) -> str | None:
        return self._compression

    def _reduce_bucket(self, k: int, params: list[nn.Parameter]) -> Stats:
        """Average bucket ``k``'s gradients over every rank (the background thread's work)."""
        grads = grads_of_params(params)
        weigh(grads, self.ctx.world_weight())
        return allreduce(grads, self.collective, self.ctx.groups, op="avg", key=("grads", k),
                         compression=self._wire, error_feedback=self.ef)

    def after_backward(self, step: int) -> None:
        ctx = self.ctx
        if self.sharded:
            self.shard_sync()
        elif self.grad_buckets is None:
            timed_barrier(ctx, ctx.groups.world)
            grads = grads_of(self.model)
            weigh(grads, ctx.world_weight())
            with ctx.timers.timed("comm"):
                self._account(allreduce(grads, self.collective, ctx.groups, op="avg", key="grads",
                                        compression=self._wire, error_feedback=self.ef))
        else:
            t0 = time.perf_counter()
            for stats in self.grad_buckets.wait():
                self._account(stats)
            ctx.timers.add("comm", time.perf_counter() - t0)
        self._inner_step()

    def _account(self, stats: Stats) -> None:
        self.ctx.account(stats)
        self.metro_bytes += stats.metro_bytes

    def finish(self, step: int) -> None:
        super().finish(step)
        self.ctx.store.set(f"{METRO_KEY}/{self.ctx.rank}", str(self.metro_bytes))

    def summary_extras(self) -> dict[str, Any]:
        """Which all-reduce ran, and what every rank sent on metro links (of the summary's wan_bytes)."""
        ranks = range(self.ctx.groups.world_size)
        metro = sum(int(self.ctx.store.get(f"{METRO_KEY}/{r}")) for r in ranks)
        return {**super().summary_extras(), "allreduce": self.collective, "wan_metro_bytes": metro}


def grads_of_params(params: list[nn.Parameter]) -> list[torch.Tensor]:
    out = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(p.grad)
    return out
