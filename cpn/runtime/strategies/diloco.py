"""``diloco``: H inner AdamW steps per site, then an outer Nesterov step on the averaged pseudo-gradient.

Inside a site the workers stay synchronous (gradient all-reduce every step), so every rank of a site
holds the same parameters and only the site leaders talk across the WAN: they average the
pseudo-gradient ``theta_global - theta_local`` over the live sites (:class:`SiteExchange`, optionally
int8/fp16 with error feedback), apply the outer optimiser to ``theta_global``, and broadcast the
result inside their site.

``overlap`` (Streaming DiLoCo's τ-delayed outer step): the exchange of round r runs in the background
while the sites train on, and is merged ``overlap_steps`` (τ) inner steps later: each site continues
from the new global parameters plus what it learnt during those τ steps
(``theta_local = theta_global + (theta_now - theta_at_exchange)``), and that part counts in the
next round's pseudo-gradient, so no work is lost and nothing is counted twice. τ is chosen so the
exchange can have arrived (:mod:`cpn.runtime.autotune`); a late one is waited for.

The last outer step of a run averages the sites' models (outer lr 1, no momentum) instead of taking
the outer optimiser's step, so the final model is not thrown past the average by the momentum.

A site that fails to answer within ``wan_timeout_seconds`` is dropped from the exchange; the others
carry on (see :class:`SiteExchange`). Checkpoints are written at outer steps.

The anchor, the global parameters and the outer momentum live on the worker's device, or in host
memory with ``device.outer_on_host`` (by default when GPU memory is short, see
:func:`cpn.runtime.device.outer_on_host`): they are touched once per H steps.
"""

from __future__ import annotations

from typing import Any

import torch

from cpn.runtime.device import HOST, outer_on_host
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
    balanced = True

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        s = ctx.cfg.strategy
        self.H = s.inner_steps or 1
        self.overlap = bool(s.overlap)
        self.tau = max(1, min(s.overlap_steps or 1, max(1, self.H - 1)))
        self.round = 0
        numel = sum(p.numel() for p in self.model.parameters())
        self.outer_device = HOST if outer_on_host(ctx.cfg.device, ctx.device, numel) else ctx.device
        self.anchor = self._flat()  # local parameters at the start of the round
        # sharded (shard="site"): every rank leads its own shard's exchange, with the same-index rank of
        # every other site (exchange "wan" for index 0, "wan-shard<j>" for the others), and keeps the outer
        # state of that shard only; the site's WAN traffic is spread over its ranks, nothing is broadcast
        self.leads = ctx.is_leader or self.sharded
        name = "wan" if ctx.groups.local_rank == 0 or not self.sharded else f"wan-shard{ctx.groups.local_rank}"
        self.exchange = SiteExchange(ctx, name) if self.leads else None
        self.pending: PendingAverage | None = None
        self.merge_at: int | None = None  # overlap: the step at which the exchange in flight is merged
        self.mark: torch.Tensor | None = None  # overlap: local parameters when the exchange started
        self.fallback: torch.Tensor | None = None  # overlap: this site's own pseudo-gradient of that round
        self.theta = torch.nn.Parameter(self.anchor.clone())  # the global (outer) parameters
        self.outer = self._outer_optimizer()
        self._live = list(range(ctx.num_sites))

    def _flat(self) -> torch.Tensor:
        """The model's parameters as one vector where the outer state lives."""
        return flat_params(self.model).to(self.outer_device)

    def _outer_optimizer(self) -> torch.optim.Optimizer:
        s = self.cfg.strategy
        momentum = s.outer_momentum or 0.0
        return torch.optim.SGD([self.theta], lr=1.0 if s.outer_lr is None else s.outer_lr, momentum=momentum,
                               nesterov=bool(s.nesterov) and momentum > 0)

    def after_backward(self, step: int) -> None:
        super().after_backward(step)
        last = step + 1 >= self.cfg.total_steps
        if self.merge_at is not None and (step >= self.merge_at or last):
            self.merge()
        if (step + 1) % self.H == 0 or last:
            if self.overlap and not last:
                self.start_round(step)
            else:
                self.outer_step(delayed=False, exchange=True, final=last)

    # overlap (Streaming DiLoCo's τ-delayed outer step) ------------------------------------------
    def start_round(self, step: int) -> None:
        """End a round without stopping: the leaders start the exchange of this round's pseudo-gradient
        and every site trains on; :meth:`merge` applies it ``overlap_steps`` later."""
        ctx = self.ctx
        if self.leads:
            local = self._flat()
            progress = local - self.anchor
            joined = self.exchange.join(self.round)
            self._live = list(self.exchange.members) if joined else [ctx.site]
            self.fallback = -progress
            self.pending = self.exchange.start(self.round, -progress) if joined else None
            self.mark = local
        self.merge_at = step + self.tau
        self.round += 1

    def merge(self) -> None:
        """Apply the exchange in flight to the global parameters and continue from them plus what the
        site learnt since the exchange started (nothing lost, nothing counted twice)."""
        ctx = self.ctx
        if self.leads:
            avg = self.pending.wait() if self.pending is not None else None
            self._apply(avg, fallback=self.fallback)
            since = self._flat() - self.mark
            self.anchor = self.theta.detach().clone()
            load_flat(self.model, self.anchor + since)
            self.pending = self.mark = self.fallback = None
        if not self.sharded:
            site_broadcast(ctx, [p.data for p in self.model.parameters()])
        if not self.leads:
            self.anchor = self._flat()
        self.merge_at = None

    # blocking outer step -------------------------------------------------------------------------
    def outer_step(self, delayed: bool, exchange: bool, final: bool = False) -> None:
        """End a round: exchange, apply the outer update, reset the site's parameters, sync the site.

        ``final``: the run's last outer step averages the sites' models (outer lr 1, no momentum), so
        the final model is not thrown past the average by the outer momentum's look-ahead."""
        ctx = self.ctx
        if self.merge_at is not None:
            self.merge()
        if self.leads:
            load_flat(self.model, self._leader_round(self._flat(), exchange, final))
        if not self.sharded:
            site_broadcast(ctx, [p.data for p in self.model.parameters()])
        self.anchor = self._flat()
        self.round += 1

    def _leader_round(self, local: torch.Tensor, exchange: bool, final: bool = False) -> torch.Tensor:
        progress = local - self.anchor
        joined = exchange and self.exchange.join(self.round)
        if exchange:
            self._live = list(self.exchange.members) if joined else [self.ctx.site]
            avg = self.exchange.start(self.round, -progress).wait() if joined else None
            self._apply(avg, fallback=-progress, final=final)
        return self.theta.detach().clone()

    def _apply(self, avg: torch.Tensor | None, fallback: torch.Tensor | None, final: bool = False) -> None:
        grad = avg if avg is not None else fallback
        if grad is None:
            return
        with self.ctx.timers.timed("compute"):
            grad = grad.to(self.outer_device, dtype=self.theta.dtype, copy=True)
            if final:
                with torch.no_grad():
                    self.theta.sub_(grad)
                return
            self.theta.grad = grad
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)

    def finish(self, step: int) -> None:
        """Merge the exchange still in flight and sync any progress since the last outer step."""
        if self.merge_at is not None:
            self.merge()
        if step % self.H != 0 and step < self.cfg.total_steps:
            self.outer_step(delayed=False, exchange=True, final=True)

    def live_sites(self) -> list[int]:
        return self._live

    def checkpoint_due(self, step: int) -> bool:
        every = self.cfg.checkpoint_every
        return bool(every) and self.ctx.checkpoint_dir is not None and step % self.H == 0 and (step // self.H) % max(1, every // self.H) == 0

    def site_state(self) -> dict[str, Any]:
        if self.merge_at is not None:  # a checkpoint must not lose the exchange in flight (every rank is here)
            self.merge()
        return {**super().site_state(), "anchor": self.anchor, "round": self.round}

    def sharded_state(self) -> dict[str, Any]:
        """Site's shards, and on site 0's ranks the outer state of their shards under ``global``."""
        if self.merge_at is not None:
            self.merge()
        state = super().sharded_state()
        if self.ctx.site == 0:
            state["global"] = self._outer_tensors()
        return state

    def sharded_template(self, sites: list[int]) -> dict[str, Any]:
        return {**super().sharded_template(sites), "global": self._outer_tensors()}

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        super().load_sharded_state(state)
        outer = state["global"]
        with torch.no_grad():
            self.theta.copy_(_flat_of(outer["theta"]).to(self.outer_device))
            if "momentum" in outer:
                self.outer.state[self.theta]["momentum_buffer"] = _flat_of(outer["momentum"]).to(self.outer_device)
        self.round = int(outer["round"])
        self.anchor = self._flat()  # a checkpoint is taken at an outer step: the site's parameters are its anchor

    def _outer_tensors(self) -> dict[str, Any]:
        """The outer parameters (and momentum) of this rank's shards, as DTensors shaped like the
        model's parameters, so DCP can reshard them."""
        out: dict[str, Any] = {"theta": _as_params(self.model, self.theta.detach()),
                               "round": torch.tensor(self.round)}
        if (self.cfg.strategy.outer_momentum or 0.0) > 0 and self.name == "diloco":
            buf = self.outer.state.get(self.theta, {}).get("momentum_buffer")
            out["momentum"] = _as_params(self.model, buf if buf is not None else torch.zeros_like(self.theta))
        return out

    def global_state(self) -> dict[str, Any]:
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
        self.anchor = site_state["anchor"].to(self.outer_device)


def _as_params(model: torch.nn.Module, flat: torch.Tensor) -> dict[str, Any]:
    """``flat`` (this rank's shards of every parameter, in order) as one DTensor per parameter,
    placed as the parameter is (copies on the parameter's device)."""
    from torch.distributed.tensor import DTensor

    out, offset = {}, 0
    for name, p in model.named_parameters():
        local = p.to_local()
        n = local.numel()
        part = flat[offset:offset + n].view_as(local).to(local.device, copy=True)
        out[name.replace("_checkpoint_wrapped_module.", "")] = DTensor.from_local(
            part, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        offset += n
    return out


def _flat_of(params: dict[str, Any]) -> torch.Tensor:
    return torch.cat([t.to_local().reshape(-1) for t in params.values()])
