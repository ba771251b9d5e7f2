"""``ps_sync`` and ``ps_backup``: parameter servers that apply one averaged update per step (seed 001).

``ps_sync``: each shard's server waits for every live worker's push of the current step, averages
them, runs AdamW once (a global-batch step, as synchronous SGD does) and only then answers every
worker with the new parameters: a barrier at the servers every step.

``ps_backup --backup-workers b`` (Chen et al., "Revisiting distributed synchronous SGD", 2016): the
servers apply the step as soon as the first N−b workers' pushes have arrived -- one set per step for
every shard, posted on the job's store by the shard that had them first (:class:`RoundServer`) -- and
answer; the b late pushes of that step are dropped (and counted: ``ps_dropped``), and their workers
get the new parameters and go on with the next step. A slow site then costs a dropped gradient, not
a stalled step.

Both share :mod:`async_ps`'s transport (sharded servers inside site leaders, a Gloo pair per worker
and direction). A push is ``[gradient shard..., progress, op, step]``; the reply is
``[parameters..., step]`` — the server's step after the update, which the worker adopts. A worker
that leaves (its budget spent, or its pair closed) no longer counts toward a step, so the others
never wait for it; a step that waits longer than ``wan_timeout_seconds`` without a set is decided and
applied with what came (a decided step waits for its accepted pushes, which are in flight to every shard).
With ``ps_replicas`` the primary forwards each step's mean gradient and learning rate (and each
leave) to its secondaries; after a fail-over the workers repeat their push to the new primary, which
counts it toward the step it is on or drops it if that step is already done.

Budget: ``ps_sync`` stops after the job's steps (one global batch each). ``ps_backup`` counts every
push a worker *computed* toward the token budget, the dropped ones too -- what the job paid for, as
Chen et al. count steps of N−b applied pushes -- so a 2× slower site out of three costs about a
fifth of the applied tokens instead of stretching the run to N/(N−b) as many steps.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter

import torch

from cpn.runtime.device import HOST
from cpn.runtime.strategies import ps_replicas
from cpn.runtime.strategies.async_ps import OP_LEAVE, OP_PULL, OP_PUSH, AsyncPS, Server, as_sent
from cpn.runtime.strategies.base import Context, grads_of, load_flat, lr_at
from cpn.runtime.strategies.ps_replicas import FWD_LEAVE, FWD_UPDATE

DROPPED = "cpn/ps/dropped"
PUSHED = "cpn/ps/pushed"
ROUND = "cpn/ps/round"  # per step: the workers whose pushes every shard applies (ps_backup)
ROUNDS = "cpn/ps/rounds"  # per replica that served: the workers it applied, per step
SHORT = "cpn/ps/short"
ROUNDS_KEPT = 2000  # steps whose applied sets a replica keeps for the summary's cross-shard check (a long job's
# every step would grow the servers' memory and the store's final message without telling more)


class RoundServer(Server):
    """A shard that applies one averaged update per step, from the pushes of the step's accepted workers.

    With backup workers the accepted set is decided once per step for the whole job: the first shard
    whose step has `quorum` pushes posts its first arrivals on the job's store (``ROUND/<step>``,
    first writer wins), and every shard applies exactly those workers' pushes -- waiting for any it has
    not received yet -- and drops the rest. Each shard picking its own first arrivals updated different
    parts of the model with different workers' gradients in one step. Workers push one step number to
    every shard (:meth:`SyncPS._tag`), so an accepted worker's push reaches every shard as that step's:
    a shard never waits for a push its sender has not already sent. Without backups the set is every
    live worker, the same at every shard, and needs no store."""

    def __init__(self, ctx: Context, shard: int, theta: torch.Tensor, workers: int, index: int, backups: int,
                 shards: int = 1):
        super().__init__(ctx, shard, theta, workers, index)
        if ctx.cfg.optimizer == "sgd":  # as the other synchronous strategies would step
            self.opt = torch.optim.SGD([self.param], lr=ctx.cfg.lr)
        self.backups = backups
        self.alone = shards == 1  # no other shard to agree a step's set with: no store round trip
        self.cond = threading.Condition(self.lock)
        self.arrived: dict[int, torch.Tensor] = {}  # this step's pushes, by worker, in arrival order
        self.accepted: tuple[int, ...] | None = None  # this step's workers, once decided (here or elsewhere)
        self.rounds: dict[int, list[int]] = {}  # per step this replica applied: the workers applied
        self.short = 0  # steps applied without every accepted push (its worker lost, or the step timed out)
        self.gone: set[int] = set()
        self.pushed_by: Counter[int] = Counter()  # per worker rank: which site's gradients the steps miss
        self.dropped_by: Counter[int] = Counter()
        self.progress = 0.0
        self.patience = ctx.cfg.strategy.wan_timeout_seconds

    def quorum(self) -> int:
        live = self.workers - len(self.gone | self.dead)
        return max(1, min(self.workers - self.backups, live))

    def _decide(self) -> None:
        """Under the lock: this step's accepted workers -- this shard's first arrivals, unless another
        shard posted its set for the step first (then that one)."""
        mine = list(self.arrived)[: self.quorum()]
        if not self.backups or self.alone:
            self.accepted = tuple(mine)
            return
        try:
            posted = self.ctx.store.compare_set(f"{ROUND}/{self.version}", "", ",".join(map(str, mine))).decode()
        except Exception:  # noqa: BLE001 - the store's host is gone: the job is ending; apply what came
            posted = ",".join(map(str, mine))
        self.accepted = tuple(int(w) for w in posted.split(","))

    def _missing(self) -> set[int]:
        assert self.accepted is not None
        return {w for w in self.accepted if w not in self.arrived} - self.gone - self.dead

    def _advance(self) -> None:
        """Under the lock: decide the step once a quorum of it is here; apply it once its accepted pushes are."""
        if self.accepted is None and self.arrived and len(self.arrived) >= self.quorum():
            self._decide()
        if self.accepted is not None and not self._missing():
            self._apply_round(self.progress)

    def _apply_round(self, progress: float) -> None:
        """Under the lock: one optimiser step on the mean of the accepted pushes here, forwarded; the
        step's other pushes are dropped."""
        if self.accepted is None:
            self._decide()
        assert self.accepted is not None
        used = [w for w in self.accepted if w in self.arrived] or list(self.arrived)
        if len(used) < len(self.accepted):
            self.short += 1
        for w in self.arrived.keys() - set(used):
            self.dropped_by[w] += 1
        lr = as_sent(lr_at(self.ctx.cfg, progress))
        mean = torch.stack([self.arrived[w] for w in used]).sum(0) / len(used)
        if len(self.rounds) < ROUNDS_KEPT:
            self.rounds[self.version] = sorted(used)
        self._step(mean, lr)
        self._forward(FWD_UPDATE, mean, lr)
        self.arrived, self.accepted = {}, None
        self.cond.notify_all()

    def push(self, worker: int, grad: torch.Tensor, progress: float, step: int) -> tuple[torch.Tensor, int]:
        """Count `grad` toward `step` (or drop it if that step is done or it was not accepted); wait until
        `step` is applied."""
        with self.cond:
            self.progress = progress
            self.pushed_by[worker] += 1
            if step == self.version and (self.accepted is None or worker in self.accepted):
                self.arrived[worker] = grad
                self._advance()
            else:
                self.dropped_by[worker] += 1
            deadline = time.monotonic() + self.patience
            while self.version <= step:
                left = deadline - time.monotonic()
                if left > 0 and self.cond.wait(timeout=left):
                    continue
                if self.version > step or not self.arrived:
                    break
                if self._overdue():
                    self._apply_round(progress)
                    break
                deadline = time.monotonic() + self.patience
            return self.param.detach().clone(), self.version

    def _overdue(self) -> bool:
        """Under the lock, once a step waited the WAN patience: whether to apply it now with what came.

        An undecided step (the others are silent) is decided here with this shard's arrivals -- or takes
        the set another shard posted meanwhile -- and applied. A decided step is applied only once its
        accepted pushes are here: each was sent to every shard before its worker waited for any reply,
        so it is in flight and comes, or its worker is lost (and no longer awaited). Applying the pushes
        that happened to be here at the patience updated this shard with another set than the shards
        that had them all -- the split step CI met under load after a fail-over (issue 36, item 7)."""
        if self.accepted is None:
            self._decide()
        return not self._missing()

    def _shrink(self) -> None:
        """Under the lock: a worker stopped counting; the step may have its quorum, or its accepted pushes, now."""
        self._advance()
        self.cond.notify_all()

    def leave(self, worker: int) -> None:
        with self.cond:
            self.gone.add(worker)
            self._forward(FWD_LEAVE, torch.zeros_like(self.param.detach()), worker=worker)
            self._shrink()

    def left(self, worker: int) -> None:
        self.gone.add(worker)

    def lost(self, worker: int) -> None:
        with self.cond:
            self.dead.add(worker)
            self._shrink()

    def handle(self, worker: int, grad: torch.Tensor, progress: float, op: float, tag: int) -> torch.Tensor:
        if not self.awaits_service():
            return self.refusal()
        if op == OP_PUSH:
            params, now = self.push(worker, grad, progress, tag)
        else:
            if op == OP_LEAVE:
                self.leave(worker)
            params, now = self.snapshot()
        return torch.cat([params, torch.tensor([float(now)], device=HOST)])


def split_steps(rounds: dict[str, dict[int, list[int]]]) -> tuple[int, int]:
    """Steps applied by two replicas or more, and those of them applied with different workers' pushes
    (0: every shard applied the same set)."""
    sets: dict[int, list[tuple[int, ...]]] = {}
    for applied in rounds.values():
        for step, workers in applied.items():
            sets.setdefault(step, []).append(tuple(workers))
    shared = [set(s) for s in sets.values() if len(s) > 1]
    return len(shared), sum(len(s) > 1 for s in shared)


class SyncPS(AsyncPS):
    """``ps_sync``: every live worker's push, every step. Steps are the servers' steps: a worker whose
    push was dropped adopts the servers' count, and all stop when the servers have made the job's
    steps (the learning-rate schedule follows the same count, as ddp's does)."""

    name = "ps_sync"
    elastic = False
    global_budget = False

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.limit = math.ceil(ctx.cfg.tokens / ctx.cfg.global_batch_tokens)

    def backups(self, workers: int) -> int:
        return 0

    def after_backward(self, step: int) -> None:
        grad = self._gradient()
        self.progress = self.server_step() / self.limit
        load_flat(self.model, self._rpc(grad, OP_PUSH))

    def _gradient(self) -> torch.Tensor:
        ctx = self.ctx
        with ctx.timers.timed("compute"):
            grad = ctx.stage.out(torch.cat([g.reshape(-1) for g in grads_of(self.model)]))
            self.opt.zero_grad(set_to_none=False)
        return grad

    def server_step(self) -> int:
        return min(self.tags.values())

    def _tag(self, k: int) -> int:
        """One step number for every shard: the oldest version pulled. A shard that replied a later version
        (its waiting thread woke after the next step was applied) drops the push as late, as every other
        shard then does -- the step's accepted set was decided without it -- so no shard waits for a push
        its worker sent under another step's number."""
        return self.server_step()

    def should_stop(self, step: int) -> bool:
        limit = self.limit if self.cfg.stop_at_step is None else min(self.limit, self.cfg.stop_at_step)
        return self.server_step() >= limit

    def make_server(self, shard: int, theta: torch.Tensor, workers: int, index: int) -> Server:
        backups = self.backups(workers)
        if backups >= workers:
            raise ValueError(f"backup_workers {backups} must be below the {workers} workers of the job")
        return RoundServer(self.ctx, shard, theta, workers, index, backups, shards=len(self.bounds))

    def finish(self, step: int) -> None:
        """Leave every server's steps (the others stop waiting for this worker), then as async_ps."""
        numel = sum(p.numel() for p in self.model.parameters())
        self._rpc(torch.zeros(numel, device=HOST), OP_LEAVE)
        servers = [s for s in self.local.values() if isinstance(s, RoundServer)]
        self._settle(servers)
        self.ctx.store.add(DROPPED, sum(sum(s.dropped_by.values()) for s in servers))
        for w in range(self.ctx.groups.world_size):
            self.ctx.store.add(f"{PUSHED}/{w}", sum(s.pushed_by[w] for s in servers))
            self.ctx.store.add(f"{DROPPED}/{w}", sum(s.dropped_by[w] for s in servers))
        self.ctx.store.add(SHORT, sum(s.short for s in servers))
        for s in servers:
            if s.rounds:
                self.ctx.store.set(f"{ROUNDS}/{s.shard}.{s.index}", json.dumps(s.rounds))
        super().finish(step)

    def _settle(self, servers: list[RoundServer]) -> None:
        """Wait (at most the WAN patience) until every worker has left, or been lost by, the shards this rank
        serves: a worker's leave follows its last push, so their counts are final then -- counted earlier, a
        shard hosted by a rank that finished first missed the other workers' last pushes."""
        everyone = set(range(self.ctx.groups.world_size))
        deadline = time.monotonic() + self.cfg.strategy.wan_timeout_seconds
        with self.ctx.timers.timed("wait"):
            for s in servers:
                with s.cond:
                    while s.serving.is_set() and not everyone <= s.gone | s.dead:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return
                        s.cond.wait(timeout=left)

    def rounds(self) -> dict[str, dict[int, list[int]]]:
        """Per replica that applied steps (``"shard.replica"``): the workers whose pushes it applied, per step."""
        store, out = self.ctx.store, {}
        for k, ranks in enumerate(self.replicas):
            for j in range(len(ranks)):
                key = f"{ROUNDS}/{k}.{j}"
                if store.check([key]):
                    out[f"{k}.{j}"] = {int(t): ws for t, ws in json.loads(store.get(key)).items()}
        return out

    def summary_extras(self) -> dict[str, object]:
        """Pushes the servers dropped (late, or not in the step's accepted set; counted by every server once
        each worker has left it), in all and per worker rank, beside the pushes each rank made (one per shard
        and step); steps applied without every accepted push (short); and, over the steps two shards or
        more applied, how many they applied with different workers' pushes (split: 0 when consistent)."""
        store, world = self.ctx.store, self.ctx.groups.world_size
        failovers = ps_replicas.failovers(store, len(self.bounds))
        compared, split = split_steps(self.rounds())
        return {"ps_dropped": store.add(DROPPED, 0), "ps_failovers": failovers,
                "ps_pushed_by_rank": [store.add(f"{PUSHED}/{w}", 0) for w in range(world)],
                "ps_dropped_by_rank": [store.add(f"{DROPPED}/{w}", 0) for w in range(world)],
                "ps_short_steps": store.add(SHORT, 0), "ps_steps_compared": compared, "ps_split_steps": split}


class BackupPS(SyncPS):
    """``ps_backup``: the first N−b pushes of a step make it; the b late ones are dropped. Every push
    computed counts toward the token budget (the job-wide counter async_ps stops on)."""

    name = "ps_backup"
    global_budget = True

    def backups(self, workers: int) -> int:
        return self.ctx.cfg.strategy.backup_workers

    def after_backward(self, step: int) -> None:
        grad = self._gradient()
        spent = self.budget.add(self.ctx.step_tokens)
        self.progress = spent / self.budget.total
        self.stop = spent >= self.budget.total
        load_flat(self.model, self._rpc(grad, OP_PUSH))

    def should_stop(self, step: int) -> bool:
        return self.stop or (self.cfg.stop_at_step is not None and step >= self.cfg.stop_at_step)


__all__ = ["OP_LEAVE", "OP_PULL", "BackupPS", "RoundServer", "SyncPS", "split_steps"]
