"""``ssp``: stale-synchronous parallel -- a site may run at most ``staleness`` steps ahead of the slowest.

Sites train on their own (synchronous inside), publish their step clock on the job's store, and
every ``inner_steps`` send their parameters to every other site through the gossip mailboxes, mixing
in the newest parameters received. Before each step the leader waits until every live site's clock
is within ``staleness`` steps (the wait is counted as waiting); its site's other ranks wait for it in
the next intra-site all-reduce. A site whose clock stalls for ``wan_timeout_seconds`` is dropped
from the bound, so a lost site does not stop the others; when its clock moves again (it was slow or
paused, not lost) it rejoins: it is gated and sent parameters again, and its own mailbox messages
(push-sum) bring it back to the consensus. A site whose channel closed (its process died) stays out.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from cpn.runtime.strategies.base import Context
from cpn.runtime.strategies.gossip import Gossip


class SSP(Gossip):
    name = "ssp"
    elastic = True

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.clocks = dist.PrefixStore("cpn/ssp/clock", ctx.store)
        self.s = ctx.cfg.strategy.staleness
        self.dropped: dict[int, int] = {}  # site -> its clock when it was dropped
        self.rejoined = 0
        if ctx.is_leader:
            self.clocks.set(str(ctx.site), "0")

    def targets(self) -> list[int]:
        return [j for j in range(self.ctx.num_sites) if j != self.ctx.site and j not in self.dropped]

    def before_step(self, step: int) -> None:
        if not self.ctx.is_leader or self.stop:
            return
        self.clocks.set(str(self.ctx.site), str(step))
        others = [j for j in range(self.ctx.num_sites) if j != self.ctx.site]
        self._readmit(others)
        last_seen = {j: (-1, time.monotonic()) for j in others}
        t0 = time.perf_counter()
        while True:
            behind = []
            for j in others:
                if j in self.dropped or j in self.mail.dead:
                    continue
                clock = int(self.clocks.get(str(j)))
                if clock != last_seen[j][0]:
                    last_seen[j] = (clock, time.monotonic())
                if clock >= step - self.s:
                    continue
                if time.monotonic() - last_seen[j][1] > self.cfg.strategy.wan_timeout_seconds:
                    self.dropped[j] = clock  # behind and stalled (a site ahead may be waiting too)
                    continue
                behind.append(j)
            if not behind or self._budget_spent():
                break
            time.sleep(0.002)
        self.ctx.timers.wait += time.perf_counter() - t0
        self._live = sorted(set(range(self.ctx.num_sites)) - set(self.dropped) - self.mail.dead)

    def _readmit(self, others: list[int]) -> None:
        """Take back a dropped site whose clock moved since it was dropped (and whose channel is open)."""
        for j in others:
            if j in self.dropped and j not in self.mail.dead and int(self.clocks.get(str(j))) != self.dropped[j]:
                del self.dropped[j]
                self.rejoined += 1

    def _budget_spent(self) -> bool:
        return self.budget.spent() >= self.budget.total

    def summary_extras(self) -> dict[str, int]:
        """How often a dropped site was taken back (rank 0's leader's count)."""
        return {"ssp_rejoined": self.rejoined}

    def finish(self, step: int) -> None:
        if self.ctx.is_leader:
            self.clocks.set(str(self.ctx.site), str(10**9))  # never hold anyone back again
        super().finish(step)
