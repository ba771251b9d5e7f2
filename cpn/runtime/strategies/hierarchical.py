"""``hierarchical``: every step, gradients through the WAN-aware all-reduce (2D torus).

Intra-site reduce-scatter, one cross-site all-reduce per local rank on a 1/W shard (optionally
fp16/bf16/int8 on the WAN with error feedback), intra-site all-gather.
"""

from __future__ import annotations

from cpn.runtime.codecs import ErrorFeedback
from cpn.runtime.collectives import allreduce
from cpn.runtime.strategies.base import Context, grads_of, timed_barrier, weigh
from cpn.runtime.strategies.ddp import DDP


class Hierarchical(DDP):
    name = "hierarchical"
    algorithm = "hierarchical"
    balanced = True

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        compression = ctx.cfg.strategy.compression
        self._compression = None if compression == "none" else compression
        self.ef = ErrorFeedback() if self._compression == "int8" else None

    @property
    def compression(self) -> str | None:
        return self._compression

    def after_backward(self, step: int) -> None:
        ctx = self.ctx
        timed_barrier(ctx, ctx.groups.world)
        grads = grads_of(self.model)
        weigh(grads, ctx.world_weight())
        with ctx.timers.timed("comm"):
            ctx.account(allreduce(grads, "hierarchical", ctx.groups, op="avg", key="grads",
                                  compression=self._compression, error_feedback=self.ef))
        self._inner_step()
