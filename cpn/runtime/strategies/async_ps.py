"""``async_ps``: sharded parameter servers apply each worker's gradient on arrival; no barrier.

The flat parameter vector is cut into ``ps`` contiguous shards; shard k lives on a server thread
inside rank ``server_ranks[k]`` (site leaders first, so servers spread over sites). Every worker,
after each micro-batch, pushes each shard's gradient to its server and pulls the shard's fresh
parameters back -- an RPC over a two-rank Gloo group per (worker, server) and direction, served by
one thread per worker on the server side. Servers run AdamW on their shard (learning rate scaled by
``1/sqrt(workers)``: each update carries one worker's micro-batch, not the global batch) and never
wait for anyone, so a slow worker only sends staler gradients. A worker that dies just stops
sending; its server threads notice the closed pair and exit.

Wire format of a push: ``[gradient shard..., progress, op]`` with op 0 = apply then reply, 1 = reply
only (the final pull). Servers keep their shard and its AdamW state in host memory (they serve
Gloo pairs from threads); workers compute on their device and stage gradients to pinned memory.
"""

from __future__ import annotations

import math
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cpn.runtime.device import HOST
from cpn.runtime.strategies.base import (
    Context,
    Strategy,
    TokenBudget,
    flat_params,
    grads_of,
    load_flat,
    lr_at,
)
from cpn.runtime.strategies.gossip import pair_group

OP_PUSH, OP_PULL = 0.0, 1.0
PS_STRATEGIES = ("async_ps", "ps_sync", "ps_backup")  # the servers own the optimiser


def server_ranks(ctx: Context, count: int) -> list[int]:
    topo = ctx.groups.topology
    order = topo.leaders + [r for r in range(topo.world_size) if r not in topo.leaders]
    if count > len(order):
        raise ValueError(f"--ps {count} exceeds the {len(order)} ranks of the job: use at most {len(order)}")
    return order[:count]


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    size = -(-numel // shards)
    return [(k * size, min(numel, (k + 1) * size)) for k in range(shards)]


class Server:
    """One parameter shard, its optimiser, and a thread per remote worker."""

    def __init__(self, ctx: Context, shard: int, theta: torch.Tensor, workers: int):
        self.ctx, self.shard = ctx, shard
        self.param = torch.nn.Parameter(theta.to(HOST, copy=True))
        self.opt = torch.optim.AdamW([self.param], lr=ctx.cfg.lr, betas=(0.9, 0.95), weight_decay=ctx.cfg.weight_decay)
        self.lr_scale = 1 / math.sqrt(workers)
        self.lock = threading.Lock()
        self.dead: set[int] = set()

    def apply(self, grad: torch.Tensor, progress: float) -> torch.Tensor:
        with self.lock:
            for group in self.opt.param_groups:
                group["lr"] = lr_at(self.ctx.cfg, progress) * self.lr_scale
            self.param.grad = grad
            self.opt.step()
            return self.param.detach().clone()

    def snapshot(self) -> torch.Tensor:
        with self.lock:
            return self.param.detach().clone()

    def serve(self, worker: int, push: dist.ProcessGroup, pull: dist.ProcessGroup) -> None:
        n = self.param.numel()
        while True:
            msg = torch.empty(n + 2, device=HOST)
            try:
                push.recv([msg], 0, 0).wait()
                grad, progress, op = msg[:n], msg[n].item(), msg[n + 1].item()
                fresh = self.apply(grad, progress) if op == OP_PUSH else self.snapshot()
                pull.send([fresh], 1, 0).wait()
            except Exception:  # noqa: BLE001 - the worker is gone
                self.dead.add(worker)
                return


class AsyncPS(Strategy):
    name = "async_ps"
    elastic = True
    global_budget = True

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.servers_at = server_ranks(ctx, ctx.cfg.strategy.ps)
        theta = flat_params(self.model)
        self.bounds = shard_bounds(theta.numel(), len(self.servers_at))
        self.budget = TokenBudget(ctx)
        self.stop = False
        world = ctx.groups.world_size
        self.local: dict[int, Server] = {}
        timeout = timedelta(days=1)
        self.push: dict[int, dist.ProcessGroup] = {}
        self.pull: dict[int, dist.ProcessGroup] = {}
        for k, srank in enumerate(self.servers_at):  # same order on every rank: no rendezvous deadlock
            lo, hi = self.bounds[k]
            if ctx.rank == srank:
                self.local[k] = self.make_server(k, theta[lo:hi], world)
            for w in range(world):
                if w == srank or ctx.rank not in (w, srank):
                    continue
                push = pair_group(ctx.store, f"ps{k}-push", w, srank, ctx.rank, timeout)
                pull = pair_group(ctx.store, f"ps{k}-pull", srank, w, ctx.rank, timeout)
                if ctx.rank == srank:
                    threading.Thread(target=self.local[k].serve, args=(w, push, pull), daemon=True).start()
                else:
                    self.push[k], self.pull[k] = push, pull

    def make_server(self, shard: int, theta: torch.Tensor, workers: int) -> Server:
        return Server(self.ctx, shard, theta, workers)

    def after_backward(self, step: int) -> None:
        ctx = self.ctx
        with ctx.timers.timed("compute"):
            grad = ctx.stage.out(torch.cat([g.reshape(-1) for g in grads_of(self.model)]))
            self.opt.zero_grad(set_to_none=False)
        spent = self.budget.add(ctx.step_tokens)
        self.progress = spent / self.budget.total
        self.stop = spent >= self.budget.total
        load_flat(self.model, self._rpc(grad, OP_PUSH))

    def _rpc(self, grad: torch.Tensor, op: float) -> torch.Tensor:
        ctx = self.ctx
        theta = torch.empty(grad.numel(), device=HOST)
        pending = []
        with ctx.timers.timed("comm"):
            for k, (lo, hi) in enumerate(self.bounds):
                if k in self.local:
                    server = self.local[k]
                    theta[lo:hi] = server.apply(grad[lo:hi], self.progress) if op == OP_PUSH else server.snapshot()
                    continue
                msg = torch.cat([grad[lo:hi], torch.tensor([self.progress, op], device=HOST)])
                self.push[k].send([msg], 1, 0).wait()
                self._count(k, msg)
                out = torch.empty(hi - lo, device=HOST)
                pending.append((lo, hi, out, self.pull[k].recv([out], 0, 0)))
            for lo, hi, out, work in pending:
                work.wait()
                theta[lo:hi] = out
        return theta

    def _count(self, k: int, msg: torch.Tensor) -> None:
        topo = self.ctx.groups.topology
        nbytes = msg.numel() * msg.element_size()
        if topo.site_of(self.servers_at[k]) == self.ctx.site:
            self.ctx.timers.intra_bytes += nbytes
        else:
            self.ctx.timers.wan_bytes += nbytes

    def set_lr(self, step: int) -> None:
        """The servers own the learning rate."""

    def should_stop(self, step: int) -> bool:
        return self.stop or (self.cfg.stop_at_step is not None and step >= self.cfg.stop_at_step)

    def finish(self, step: int) -> None:
        """Rank 0 pulls the final parameters once every live worker is done; servers stay up till then."""
        ctx = self.ctx
        ctx.store.set(f"cpn/ps/done/{ctx.rank}", "1")
        patience = 4 * ctx.cfg.strategy.wan_timeout_seconds
        if ctx.rank == 0:
            deadline = time.monotonic() + patience
            for w in range(ctx.groups.world_size):
                while not ctx.store.check([f"cpn/ps/done/{w}"]) and time.monotonic() < deadline:
                    if any(w in s.dead for s in self.local.values()):
                        break
                    time.sleep(0.01)
            numel = sum(p.numel() for p in self.model.parameters())
            load_flat(self.model, self._rpc(torch.zeros(numel, device=HOST), OP_PULL))
            ctx.store.set("cpn/ps/released", "1")
            topo = ctx.groups.topology
            finished = [w for w in range(topo.world_size) if ctx.store.check([f"cpn/ps/done/{w}"])]
            self._live = sorted({topo.site_of(w) for w in finished})
        elif self.local:
            deadline = time.monotonic() + patience
            with ctx.timers.timed("wait"):
                while not ctx.store.check(["cpn/ps/released"]) and time.monotonic() < deadline:
                    time.sleep(0.01)

    _live: list[int] | None = None

    def live_sites(self) -> list[int]:
        if self._live is not None:
            return self._live
        topo = self.ctx.groups.topology
        dead = set().union(*(s.dead for s in self.local.values())) if self.local else set()
        return sorted({topo.site_of(r) for r in range(topo.world_size) if r not in dead})

    def site_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict()}

    def load_state(self, site_state: dict[str, Any] | None, global_state: dict[str, Any]) -> None:
        if site_state is not None:
            self.model.load_state_dict(site_state["model"])
