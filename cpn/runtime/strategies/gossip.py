"""``gossip``: each site averages with one or two neighbours per round; no global barrier.

Mixing is push-sum (Kempe et al. 2003; as in Stochastic Gradient Push, Assran et al. 2019): each
site holds a weight ``w`` besides its parameters θ, grown by the work it does (its tokens since the
last round, in global batches). A round adds what arrived (messages carry ``w·θ`` and ``w``) to the
site's own ``w·θ`` and ``w``, keeps 1/(k+1) of both and sends the same share to each of its k
neighbours; θ is numerator over weight. Nothing is lost or counted twice, so however uneven the
sites' speeds or the graph, the sites agree on the average of their parameters weighted by the work
behind them, not on a mean that over-weights whoever happens to send (:func:`push_sum`).

Site leaders talk through :class:`Mailboxes`: one two-rank Gloo group per ordered pair of sites
(i -> j), a sender thread per outgoing pair and a receiver thread per incoming pair. A message not
yet sent when the next is posted is summed with it, and arrivals not yet mixed in are summed (push-sum
mass is conserved). Gloo's point-to-point work cannot be polled (``is_completed`` stays false until
``wait``, and a ``wait`` timeout closes the pair), hence the threads. A fast site therefore never
waits for a slow one: it mixes in whatever its neighbours sent so far.

The graph varies with the round: in round r site i sends to ``i +/- 2**(r mod ceil(log2 S))``
(one neighbour, or two with ``gossip_neighbours=2``) -- an exponential graph, which mixes in
O(log S) rounds. Inside a site the workers stay synchronous. A neighbour whose channel fails is
dropped. At the end the live sites average once (the only barrier), so the run has one final model.
Messages travel in host memory (Gloo); the mixing happens on the worker's device.
"""

from __future__ import annotations

import math
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cpn.runtime.config import trim_shares
from cpn.runtime.device import HOST
from cpn.runtime.strategies.base import (
    Context,
    SiteExchange,
    Strategy,
    TokenBudget,
    flat_params,
    host_copy,
    load_flat,
    site_broadcast,
    site_sync_grads,
    site_values,
)


def pair_group(store: dist.Store, name: str, src: int, dst: int, me: int, timeout: timedelta) -> dist.ProcessGroup:
    """A two-rank Gloo group for messages src -> dst (rank 0 = src)."""
    prefixed = dist.PrefixStore(f"cpn/{name}/{src}-{dst}", store)
    pg = dist.ProcessGroupGloo(prefixed, 0 if me == src else 1, 2, timeout)
    pg.allreduce([torch.zeros(1, device=HOST)]).wait()  # connect the pair now: a receive cannot open it lazily
    return pg


def push_sum(theta: torch.Tensor, weight: float, received: list[torch.Tensor], targets: int
             ) -> tuple[torch.Tensor, float, torch.Tensor | None]:
    """One push-sum round of one site: ``(θ, w, message)`` after adding the ``received`` messages (each
    ``[w·θ…, w]``) to this site's ``w·θ`` and ``w`` and keeping 1/(targets+1) of the sum; the message
    (the same share, for each of the ``targets``) is None without targets."""
    y, w = theta * weight, float(weight)
    for m in received:
        y = y + m[:-1].to(y.device)
        w += float(m[-1])
    if w <= 0:
        return theta, weight, None
    share = 1.0 / (targets + 1)
    y, w = y * share, w * share
    message = torch.cat([y, torch.tensor([w], dtype=y.dtype, device=y.device)]) if targets else None
    return y / w, w, message


class Mailboxes:
    """Summing channels between this site and every other site: an unsent message and an unread
    arrival absorb the next one (push-sum mass is never dropped)."""

    def __init__(self, ctx: Context, numel: int, name: str = "gossip"):
        self.me, self.numel, self.stage = ctx.site, numel, ctx.stage
        self.lock = threading.Lock()
        self.inbox: dict[int, torch.Tensor] = {}
        self.outbox: dict[int, torch.Tensor] = {}
        self.wake = {j: threading.Event() for j in range(ctx.num_sites) if j != self.me}
        self.dead: set[int] = set()
        self.sent_bytes = 0
        timeout = timedelta(days=1)  # receivers block until a message comes; a dead peer closes the pair
        pairs = sorted((i, j) for i in range(ctx.num_sites) for j in range(ctx.num_sites) if i != j and self.me in (i, j))
        self.groups = {pair: pair_group(ctx.store, name, *pair, self.me, timeout) for pair in pairs}
        for (i, j), pg in self.groups.items():
            target = self._send_loop if i == self.me else self._recv_loop
            peer = j if i == self.me else i
            threading.Thread(target=target, args=(peer, pg), daemon=True, name=f"{name}-{i}-{j}").start()

    def post(self, peer: int, vec: torch.Tensor) -> None:
        if peer in self.dead:
            return
        host = host_copy(self.stage, vec)
        with self.lock:
            unsent = self.outbox.get(peer)
            self.outbox[peer] = host if unsent is None else unsent.add_(host)
        self.wake[peer].set()

    def take(self) -> dict[int, torch.Tensor]:
        """What arrived since the last call, summed per peer."""
        with self.lock:
            got, self.inbox = self.inbox, {}
        return got

    def _send_loop(self, peer: int, pg: dist.ProcessGroup) -> None:
        while True:
            self.wake[peer].wait()
            with self.lock:
                self.wake[peer].clear()
                vec = self.outbox.pop(peer, None)
            if vec is None:
                continue
            try:
                pg.send([vec], 1, 0).wait()
            except Exception:  # noqa: BLE001 - the peer died
                self.dead.add(peer)
                return
            self.sent_bytes += vec.numel() * vec.element_size()

    def _recv_loop(self, peer: int, pg: dist.ProcessGroup) -> None:
        while True:
            buf = torch.empty(self.numel, device=HOST)
            try:
                pg.recv([buf], 0, 0).wait()
            except Exception:  # noqa: BLE001
                self.dead.add(peer)
                return
            with self.lock:
                unread = self.inbox.get(peer)
                self.inbox[peer] = buf if unread is None else unread.add_(buf)


def neighbours(site: int, sites: int, rnd: int, count: int) -> list[int]:
    if sites < 2:
        return []
    hops = max(1, math.ceil(math.log2(sites)))
    d = 2 ** (rnd % hops)
    out = [(site + d) % sites]
    if count > 1:
        out.append((site - d) % sites)
    return sorted({j for j in out if j != site})


class Gossip(Strategy):
    name = "gossip"
    elastic = True
    global_budget = True

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.H = ctx.cfg.strategy.inner_steps
        self.budget = TokenBudget(ctx)
        self.stop = False
        self.round = 0
        numel = sum(p.numel() for p in self.model.parameters()) + 1  # push-sum messages: [w·θ, w]
        self.mail = Mailboxes(ctx, numel, self.name) if ctx.is_leader else None
        self.weight = 0.0  # push-sum weight: the work behind this site's parameters, in global batches
        self._work = 0  # tokens this site trained since its last round
        self.final_exchange = SiteExchange(ctx, f"{self.name}-final") if ctx.is_leader else None
        self._live = list(range(ctx.num_sites))
        self._counted = 0

    def plan_step(self, step: int) -> None:
        """The site leader reserves its site's tokens of this step on the job-wide counter before the
        step; the site that crosses the budget trains only what is left of it (trimmed as
        :meth:`Strategy.plan_step` does), so the job trains exactly ``cfg.tokens``."""
        ctx = self.ctx
        ctx.step_share = None
        want = ctx.site_step_tokens
        reserved = self.budget.add(want) if ctx.is_leader else 0
        granted = min(want, max(0, self.budget.total - (reserved - want)))
        self.progress, stop, granted = site_values(ctx, min(reserved, self.budget.total) / self.budget.total,
                                                   float(reserved >= self.budget.total), float(granted))
        self.stop = bool(stop)
        if int(granted) < want:
            site = ctx.groups.topology.ranks_of(ctx.site)
            share = trim_shares(int(granted), [ctx.share_of(r) for r in site], self.cfg.seq_len)
            trimmed = [ctx.tokens_of(r) for r in range(ctx.groups.world_size)]
            for r, n in zip(site, share, strict=True):
                trimmed[r] = n
            ctx.step_share = trimmed

    def after_backward(self, step: int) -> None:
        site_sync_grads(self.ctx)
        if self.ctx.site_step_tokens:
            self._inner_step()
        self._work += self.ctx.site_step_tokens
        if (step + 1) % self.H == 0 and not self.stop:
            self.exchange(step + 1)

    def exchange(self, step: int) -> None:
        ctx = self.ctx
        if ctx.is_leader:
            with ctx.timers.timed("comm"):
                self._mix_and_send()
        site_broadcast(ctx, [p.data for p in self.model.parameters()])
        self.round += 1

    def targets(self) -> list[int]:
        return neighbours(self.ctx.site, self.ctx.num_sites, self.round, self.cfg.strategy.gossip_neighbours)

    def _mix_and_send(self) -> None:
        self.weight += self._work / self.cfg.global_batch_tokens
        self._work = 0
        targets = [j for j in self.targets() if j not in self.mail.dead]
        theta, self.weight, message = push_sum(flat_params(self.model), self.weight, list(self.mail.take().values()),
                                               len(targets))
        load_flat(self.model, theta)
        for j in targets:
            self.mail.post(j, message)
        self._account_wan()
        self._live = sorted(set(range(self.ctx.num_sites)) - self.mail.dead)

    def should_stop(self, step: int) -> bool:
        return self.stop or (self.cfg.stop_at_step is not None and step >= self.cfg.stop_at_step)

    def finish(self, step: int) -> None:
        """One averaging round among the live sites, so the run ends with a single model."""
        ctx = self.ctx
        if ctx.is_leader:
            ex = self.final_exchange
            local = flat_params(self.model)
            if ex.join(0):
                avg = ex.start(0, local).wait()
                if avg is not None:
                    load_flat(self.model, avg)
                self._live = list(ex.members)
            self._account_wan()
        site_broadcast(ctx, [p.data for p in self.model.parameters()])

    def _account_wan(self) -> None:
        """Bytes the sender threads moved since the last call (they send in the background)."""
        sent = self.mail.sent_bytes
        self.ctx.timers.wan_bytes += sent - self._counted
        self._counted = sent

    def live_sites(self) -> list[int]:
        return self._live

    def site_state(self) -> dict[str, Any]:
        return {**super().site_state(), "push_weight": self.weight + self._work / self.cfg.global_batch_tokens}

    def load_state(self, site_state: dict[str, Any] | None, global_state: dict[str, Any]) -> None:
        super().load_state(site_state, global_state)
        if site_state is not None:
            self.weight, self._work = float(site_state.get("push_weight", 0.0)), 0
