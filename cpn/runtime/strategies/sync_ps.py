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
"""

from __future__ import annotations

import math
import threading
import time

import torch
import torch.distributed as dist

from cpn.runtime.device import HOST
from cpn.runtime.strategies.async_ps import OP_PULL, OP_PUSH, AsyncPS, Server
from cpn.runtime.strategies.base import Context, grads_of, load_flat, lr_at

OP_LEAVE = 2.0
DROPPED = "cpn/ps/dropped"


class RoundServer(Server):
    """A shard that applies one averaged update per step, from the first `quorum` pushes of it."""

    def __init__(self, ctx: Context, shard: int, theta: torch.Tensor, workers: int, backups: int):
        super().__init__(ctx, shard, theta, workers)
        if ctx.cfg.optimizer == "sgd":  # as the other synchronous strategies would step
            self.opt = torch.optim.SGD([self.param], lr=ctx.cfg.lr)
        self.workers, self.backups = workers, backups
        self.cond = threading.Condition(self.lock)
        self.step = 0
        self.acc = torch.zeros_like(self.param.detach())
        self.count = 0
        self.left: set[int] = set()
        self.dropped = 0
        self.patience = ctx.cfg.strategy.wan_timeout_seconds

    def quorum(self) -> int:
        live = self.workers - len(self.left | self.dead)
        return max(1, min(self.workers - self.backups, live))

    def _apply_round(self, progress: float) -> None:
        """Under the lock: one AdamW step on the mean of this step's pushes."""
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.ctx.cfg, progress)
        self.param.grad = self.acc / self.count
        self.opt.step()
        self.acc.zero_()
        self.count = 0
        self.step += 1
        self.cond.notify_all()

    def push(self, worker: int, grad: torch.Tensor, progress: float, step: int) -> tuple[torch.Tensor, int]:
        """Count `grad` toward `step` (or drop it if that step is done); wait until `step` is applied."""
        with self.cond:
            if step == self.step:
                self.acc += grad
                self.count += 1
                if self.count >= self.quorum():
                    self._apply_round(progress)
            else:
                self.dropped += 1
            deadline = time.monotonic() + self.patience
            while self.step <= step:
                left = deadline - time.monotonic()
                if left <= 0 or not self.cond.wait(timeout=left):
                    if self.step <= step and self.count:  # the others are silent: apply what came
                        self._apply_round(progress)
                    break
            return self.param.detach().clone(), self.step

    def leave(self, worker: int) -> None:
        with self.cond:
            self.left.add(worker)
            if self.count and self.count >= self.quorum():
                self._apply_round(1.0)
            self.cond.notify_all()

    def serve(self, worker: int, push: dist.ProcessGroup, pull: dist.ProcessGroup) -> None:
        n = self.param.numel()
        while True:
            msg = torch.empty(n + 3, device=HOST)
            try:
                push.recv([msg], 0, 0).wait()
                progress, op, step = msg[n].item(), msg[n + 1].item(), int(msg[n + 2].item())
                if op == OP_PUSH:
                    fresh, now = self.push(worker, msg[:n], progress, step)
                else:
                    if op == OP_LEAVE:
                        self.leave(worker)
                    fresh, now = self.snapshot(), self.step
                pull.send([torch.cat([fresh, torch.tensor([float(now)], device=HOST)])], 1, 0).wait()
            except Exception:  # noqa: BLE001 - the worker is gone
                with self.cond:
                    self.dead.add(worker)
                    self.cond.notify_all()
                return


class SyncPS(AsyncPS):
    """``ps_sync``: every live worker's push, every step. Steps are the servers' steps: a worker whose
    push was dropped adopts the servers' count, and all stop when the servers have made the job's
    steps (the learning-rate schedule follows the same count, as ddp's does). ``ps_backup`` makes
N/(N−b) times as many steps, so that its applied pushes carry the job's token budget."""

    name = "ps_sync"
    elastic = False
    global_budget = False

    def __init__(self, ctx: Context):
        self.steps: dict[int, int] = {}
        super().__init__(ctx)
        self.steps = dict.fromkeys(range(len(self.bounds)), 0)
        workers = ctx.groups.world_size
        # a step applies N-b workers' pushes: the budget is the tokens in applied pushes
        applied = ctx.cfg.global_batch_tokens * (workers - self.backups(workers)) / workers
        self.limit = math.ceil(ctx.cfg.tokens / applied)

    def backups(self, workers: int) -> int:
        return 0

    def after_backward(self, step: int) -> None:
        ctx = self.ctx
        with ctx.timers.timed("compute"):
            grad = ctx.stage.out(torch.cat([g.reshape(-1) for g in grads_of(self.model)]))
            self.opt.zero_grad(set_to_none=False)
        self.progress = self.server_step() / self.limit
        load_flat(self.model, self._rpc(grad, OP_PUSH))

    def server_step(self) -> int:
        return min(self.steps.values())

    def should_stop(self, step: int) -> bool:
        limit = self.limit if self.cfg.stop_at_step is None else min(self.limit, self.cfg.stop_at_step)
        return self.server_step() >= limit

    def make_server(self, shard: int, theta: torch.Tensor, workers: int) -> Server:
        backups = self.backups(workers)
        if backups >= workers:
            raise ValueError(f"backup_workers {backups} must be below the {workers} workers of the job")
        return RoundServer(self.ctx, shard, theta, workers, backups)

    def _rpc(self, grad: torch.Tensor, op: float) -> torch.Tensor:
        ctx = self.ctx
        theta = torch.empty(grad.numel(), device=HOST)
        pending = []
        with ctx.timers.timed("comm"):
            for k, (lo, hi) in enumerate(self.bounds):
                if k in self.local:
                    server = self.local[k]
                    if op == OP_PUSH:
                        out, self.steps[k] = server.push(ctx.rank, grad[lo:hi], self.progress, self.steps[k])
                    else:
                        if op == OP_LEAVE:
                            server.leave(ctx.rank)
                        out = server.snapshot()
                    theta[lo:hi] = out
                    continue
                head = torch.tensor([self.progress, op, float(self.steps[k])], device=HOST)
                msg = torch.cat([grad[lo:hi], head])
                self.push[k].send([msg], 1, 0).wait()
                self._count(k, msg)
                out = torch.empty(hi - lo + 1, device=HOST)
                pending.append((k, lo, hi, out, self.pull[k].recv([out], 0, 0)))
            for k, lo, hi, out, work in pending:
                work.wait()
                theta[lo:hi] = out[:-1]
                self.steps[k] = int(out[-1].item())
        return theta

    def finish(self, step: int) -> None:
        """Leave every server's steps (the others stop waiting for this worker), then as async_ps."""
        numel = sum(p.numel() for p in self.model.parameters())
        self._rpc(torch.zeros(numel, device=HOST), OP_LEAVE)
        self.ctx.store.add(DROPPED, sum(getattr(s, "dropped", 0) for s in self.local.values()))
        super().finish(step)

    def summary_extras(self) -> dict[str, int]:
        """Pushes the servers dropped as late (counted by every server before it reports done)."""
        return {"ps_dropped": self.ctx.store.add(DROPPED, 0)}


class BackupPS(SyncPS):
    """``ps_backup``: the first N−b pushes of a step make it; the b late ones are dropped."""

    name = "ps_backup"

    def backups(self, workers: int) -> int:
        return self.ctx.cfg.strategy.backup_workers


__all__ = ["OP_LEAVE", "OP_PULL", "BackupPS", "RoundServer", "SyncPS"]
