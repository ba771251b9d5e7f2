"""``ddp``: every step, gradients all-reduced over every rank (one flat ring, as torch DDP does)."""

from __future__ import annotations

from typing import ClassVar

from cpn.runtime.collectives import allreduce
from cpn.runtime.strategies.base import Strategy, grads_of, timed_barrier, weigh


class DDP(Strategy):
    name = "ddp"
    algorithm: ClassVar[str] = "flat"

    def after_backward(self, step: int) -> None:
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
