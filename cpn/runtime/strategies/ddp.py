"""``ddp``: every step, gradients all-reduced over every rank (one flat ring, as torch DDP does)."""

from __future__ import annotations

from typing import ClassVar

from cpn.runtime.codecs import ErrorFeedback, needs_error_feedback
from cpn.runtime.collectives import allreduce
from cpn.runtime.sharding import cross_site_average, local_tensors
from cpn.runtime.strategies.base import Strategy, grads_of, timed_barrier, weigh


class DDP(Strategy):
    name = "ddp"
    algorithm: ClassVar[str] = "flat"

    def after_backward(self, step: int) -> None:
        if self.sharded:
            self.shard_sync()
            self._inner_step()
            return
        ctx = self.ctx
        timed_barrier(ctx, ctx.groups.world)
        grads = grads_of(self.model)
        weigh(grads, ctx.world_weight())
        with ctx.timers.timed("comm"):
            ctx.account(allreduce(grads, self.algorithm, ctx.groups, op="avg", key="grads",
                                  compression=self.compression))
        self._inner_step()

    @property
    def compression(self) -> str | None:
        return None

    def shard_sync(self) -> None:
        """A sharded model (HSDP): backward reduce-scattered the gradients over the site; average each
        rank's gradient shard with the same-index rank of every other site (the only WAN traffic)."""
        ctx = self.ctx
        timed_barrier(ctx, ctx.groups.cross)
        if not hasattr(self, "_shard_ef"):
            self._shard_ef = ErrorFeedback() if needs_error_feedback(self.compression) else None
        with ctx.timers.timed("comm"):
            ctx.timers.wan_bytes += cross_site_average(local_tensors(grads_of(self.model)), ctx.groups,
                                                       codec_name=self.compression, ef=self._shard_ef)
