"""``diloco``: H inner AdamW steps per site, then an outer Nesterov step on the averaged pseudo-gradient.

Inside a site the workers stay synchronous (gradient all-reduce every step), so every rank of a site
holds the same parameters and only the site leaders talk across the WAN: they average the
pseudo-gradient ``theta_global - theta_local`` over the live sites (:class:`SiteExchange`, optionally
int8/fp16 with error feedback), apply the outer optimiser to ``theta_global``, and broadcast the
result inside their site.

``overlap`` (streaming / one-step-delayed DiLoCo): the exchange of round r runs in the background
during round r+1 and is applied at the end of r+1. Each site keeps its own un-averaged progress of
the round on top of the newest global parameters (``theta_local = theta_global + d_r``), so no work
is lost and nothing is counted twice.

A site that fails to answer within ``wan_timeout_seconds`` is dropped from the exchange; the others
carry on (see :class:`SiteExchange`). Checkpoints are written at outer steps.
"""

from __future__ import annotations

from typing import Any

import torch

from cpn.runtime.strategies.base import (
    Context,
    PendingAverage,
    SiteExchange,
    Strategy,
    flat_params,
    load_flat,
    site_broadcast,
)


class DiLoCo(Strategy):
    name = "diloco"
    elastic = True

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        s = ctx.cfg.strategy
        self.H = s.inner_steps
        self.overlap = s.overlap
        self.round = 0
        self.anchor = flat_params(self.model)  # local parameters at the start of the round
        self.exchange = SiteExchange(ctx) if ctx.is_leader else None
        self.pending: PendingAverage | None = None
        self.theta = torch.nn.Parameter(self.anchor.clone())  # the global (outer) parameters
        self.outer = self._outer_optimizer()
        self._live = list(range(ctx.num_sites))

    def _outer_optimizer(self) -> torch.optim.Optimizer:
        s = self.cfg.strategy
        return torch.optim.SGD([self.theta], lr=s.outer_lr, momentum=s.outer_momentum, nesterov=s.nesterov)

    def after_backward(self, step: int) -> None:
        super().after_backward(step)
        if (step + 1) % self.H == 0 or step + 1 >= self.cfg.total_steps:
            self.outer_step(delayed=self.overlap, exchange=True)

    def outer_step(self, delayed: bool, exchange: bool) -> None:
        """End a round: exchange, apply the outer update, reset the site's parameters, sync the site."""
        ctx = self.ctx
        if ctx.is_leader:
            load_flat(self.model, self._leader_round(flat_params(self.model), delayed, exchange))
        site_broadcast(ctx, [p.data for p in self.model.parameters()])
        self.anchor = flat_params(self.model)
        self.round += 1

    def _leader_round(self, local: torch.Tensor, delayed: bool, exchange: bool) -> torch.Tensor:
        progress = local - self.anchor
        if self.pending is not None:
            self._apply(self.pending.wait(), fallback=None)
            self.pending = None
        joined = exchange and self.exchange.join(self.round)
        if exchange:
            self._live = list(self.exchange.members) if joined else [self.ctx.site]
        if delayed:  # this round's pseudo-gradient (-progress) is applied one round late
            self.pending = self.exchange.start(self.round, -progress) if joined else None
            return self.theta.detach() + progress
        if exchange:
            avg = self.exchange.start(self.round, -progress).wait() if joined else None
            self._apply(avg, fallback=-progress)
        return self.theta.detach().clone()

    def _apply(self, avg: torch.Tensor | None, fallback: torch.Tensor | None) -> None:
        grad = avg if avg is not None else fallback
        if grad is None:
            return
        with self.ctx.timers.timed("compute"):
            self.theta.grad = grad.clone()
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)

    def finish(self, step: int) -> None:
        """Apply the exchange still in flight and sync any progress since the last outer step."""
        unsynced = step % self.H != 0 and step < self.cfg.total_steps
        if self.overlap or unsynced:
            self.outer_step(delayed=False, exchange=unsynced)

    def live_sites(self) -> list[int]:
        return self._live

    def checkpoint_due(self, step: int) -> bool:
        every = self.cfg.checkpoint_every
        return bool(every) and self.ctx.checkpoint_dir is not None and step % self.H == 0 and (step // self.H) % max(1, every // self.H) == 0

    def site_state(self) -> dict[str, Any]:
        return {**super().site_state(), "anchor": self.anchor, "round": self.round}

    def global_state(self) -> dict[str, Any]:
        if self.pending is not None:  # a checkpoint must not lose the exchange in flight
            self._apply(self.pending.wait(), fallback=None)
            self.pending = None
        return {"theta": self.theta.detach(), "outer": self.outer.state_dict(), "round": self.round}

    def load_state(self, site_state: dict[str, Any] | None, global_state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.theta.copy_(global_state["theta"])
        self.outer.load_state_dict(global_state["outer"])
        self.round = global_state["round"]
        if site_state is None:  # a site rejoining from the global state
            load_flat(self.model, self.theta.detach())
            self.anchor = self.theta.detach().clone()
            return
        super().load_state(site_state, global_state)
        self.anchor = site_state["anchor"]
