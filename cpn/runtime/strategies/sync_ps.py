"""``ps_sync`` and ``ps_backup``: parameter servers that apply one averaged update per step (seed 001).

``ps_sync``: each shard's server waits for every live worker's push of the current step, averages
them, runs AdamW once (a global-batch step, as synchronous SGD does) and only then answers every
worker with the new parameters: a barrier at the servers every step.

``ps_backup --backup-workers b`` (Chen et al., "Revisiting distributed synchronous SGD", 2016): the
server applies the step as soon as the first N−b pushes have arrived and answers; the b late pushes
of that step are dropped (and counted: ``ps_dropped``), and their workers get the new parameters and
go on with the next step. A slow site then costs a dropped gradient, not a stalled step.

Both share :mod:`async_ps`'s transport (sharded servers inside site leaders, a Gloo pair per worker
and direction). A push is ``[gradient shard..., progress, op, step]``; the reply is
``[parameters..., step]`` — the server's step after the update, which the worker adopts. A worker
that leaves (its budget spent, or its pair closed) no longer counts toward a step, so the others
never wait for it; a step that waits longer than ``wan_timeout_seconds`` is applied with what came.
With ``ps_replicas`` the primary forwards each step's mean gradient and learning rate (and each
leave) to its secondaries; after a fail-over the workers repeat their push to the new primary, which
counts it toward the step it is on or drops it if that step is already done.

Budget: ``ps_sync`` stops after the job's steps (one global batch each). ``ps_backup`` counts every
push a worker *computed* toward the token budget, the dropped ones too -- what the job paid for, as
Chen et al. count steps of N−b applied pushes -- so a 2× slower site out of three costs about a
fifth of the applied tokens instead of stretching the run to N/(N−b) as many steps.
"""

from __future__ import annotations

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


class RoundServer(Server):
    """A shard that applies one averaged update per step, from the first `quorum` pushes of it."""

    def __init__(self, ctx: Context, shard: int, theta: torch.Tensor, workers: int, index: int, backups: int):
        super().__init__(ctx, shard, theta, workers, index)
        if ctx.cfg.optimizer == "sgd":  # as the other synchronous strategies would step
            self.opt = torch.optim.SGD([self.param], lr=ctx.cfg.lr)
        self.backups = backups
        self.cond = threading.Condition(self.lock)
        self.acc = torch.zeros_like(self.param.detach())
        self.count = 0
        self.gone: set[int] = set()
        self.dropped = 0
        self.pushed_by: Counter[int] = Counter()  # per worker rank: which site's gradients the steps miss
        self.dropped_by: Counter[int] = Counter()
        self.progress = 0.0
        self.patience = ctx.cfg.strategy.wan_timeout_seconds

    def quorum(self) -> int:
        live = self.workers - len(self.gone | self.dead)
        return max(1, min(self.workers - self.backups, live))

    def _apply_round(self, progress: float) -> None:
        """Under the lock: one optimiser step on the mean of this step's pushes, forwarded."""
        lr = as_sent(lr_at(self.ctx.cfg, progress))
        mean = self.acc / self.count
        self._step(mean, lr)
        self._forward(FWD_UPDATE, mean, lr)
        self.acc.zero_()
        self.count = 0
        self.cond.notify_all()

    def push(self, worker: int, grad: torch.Tensor, progress: float, step: int) -> tuple[torch.Tensor, int]:
        """Count `grad` toward `step` (or drop it if that step is done); wait until `step` is applied."""
        with self.cond:
            self.progress = progress
            self.pushed_by[worker] += 1
            if step == self.version:
                self.acc += grad
                self.count += 1
                if self.count >= self.quorum():
                    self._apply_round(progress)
            else:
                self.dropped += 1
                self.dropped_by[worker] += 1
            deadline = time.monotonic() + self.patience
            while self.version <= step:
                left = deadline - time.monotonic()
                if left <= 0 or not self.cond.wait(timeout=left):
                    if self.version <= step and self.count:  # the others are silent: apply what came
                        self._apply_round(progress)
                    break
            return self.param.detach().clone(), self.version

    def _shrink(self) -> None:
        """Under the lock: a worker stopped counting; the step may have its quorum now."""
        if self.count and self.count >= self.quorum():
            self._apply_round(self.progress)
        self.cond.notify_all()

    def leave(self, worker: int) -> None:
        with self.cond:
            self.gone.add(worker)
            self._forward(FWD_LEAVE, torch.zeros_like(self.acc), worker=worker)
            self._shrink()

    def left(self, worker: int) -> None:
        self.gone.add(worker)

    def lost(self, worker: int) -> None:
        with self.cond:
            self.dead.add(worker)
            self._shrink()

    def handle(self, worker: int, grad: torch.Tensor, progress: float, op: float, tag: int) -> torch.Tensor:
        self.serving.wait()
        if op == OP_PUSH:
            params, now = self.push(worker, grad, progress, tag)
        else:
            if op == OP_LEAVE:
                self.leave(worker)
            params, now = self.snapshot()
        return torch.cat([params, torch.tensor([float(now)], device=HOST)])


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

    def should_stop(self, step: int) -> bool:
        limit = self.limit if self.cfg.stop_at_step is None else min(self.limit, self.cfg.stop_at_step)
        return self.server_step() >= limit

    def make_server(self, shard: int, theta: torch.Tensor, workers: int, index: int) -> Server:
        backups = self.backups(workers)
        if backups >= workers:
            raise ValueError(f"backup_workers {backups} must be below the {workers} workers of the job")
        return RoundServer(self.ctx, shard, theta, workers, index, backups)

    def finish(self, step: int) -> None:
        """Leave every server's steps (the others stop waiting for this worker), then as async_ps."""
        numel = sum(p.numel() for p in self.model.parameters())
        self._rpc(torch.zeros(numel, device=HOST), OP_LEAVE)
        servers = [s for s in self.local.values() if isinstance(s, RoundServer)]
        self.ctx.store.add(DROPPED, sum(s.dropped for s in servers))
        for w in range(self.ctx.groups.world_size):
            self.ctx.store.add(f"{PUSHED}/{w}", sum(s.pushed_by[w] for s in servers))
            self.ctx.store.add(f"{DROPPED}/{w}", sum(s.dropped_by[w] for s in servers))
        super().finish(step)

    def summary_extras(self) -> dict[str, object]:
        """Pushes the servers dropped as late (counted by every server before it reports done), in all
        and per worker rank, beside the pushes each rank made (one per shard and step)."""
        store, world = self.ctx.store, self.ctx.groups.world_size
        failovers = ps_replicas.failovers(store, len(self.bounds))
        return {"ps_dropped": store.add(DROPPED, 0), "ps_failovers": failovers,
                "ps_pushed_by_rank": [store.add(f"{PUSHED}/{w}", 0) for w in range(world)],
                "ps_dropped_by_rank": [store.add(f"{DROPPED}/{w}", 0) for w in range(world)]}


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


__all__ = ["OP_LEAVE", "OP_PULL", "BackupPS", "RoundServer", "SyncPS"]
