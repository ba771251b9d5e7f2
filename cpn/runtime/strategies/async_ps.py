"""``async_ps``: sharded parameter servers apply each worker's gradient on arrival; no barrier.

The flat parameter vector is cut into ``ps`` contiguous shards; shard k lives on a server thread
inside rank ``server_ranks[k]`` (site leaders first, so servers spread over sites). Every worker,
after each micro-batch, pushes each shard's gradient to its server and pulls the shard's fresh
parameters back -- an RPC over a two-rank Gloo group per (worker, server) and direction, served by
one thread per worker on the server side. Servers run AdamW on their shard (learning rate scaled by
``1/sqrt(workers)``: each update carries one worker's micro-batch, not the global batch) and never
wait for anyone, so a slow worker only sends staler gradients. A worker that dies just stops
sending; its server threads notice the closed pair and exit.

Staleness damping (``ps_damping``, Zhang et al., "Staleness-aware async-SGD", 2016): a push computed
on parameters ``s`` server versions old gets the learning rate times ``min(1, N / (1 + s))``. With
N workers at one pace a push is about N−1 versions old and keeps the full rate; a straggler's
older gradients are damped in proportion to their age, so they no longer drag the loss up.

Replicas (``ps_replicas``, :mod:`cpn.runtime.strategies.ps_replicas`): each shard has a primary and
r secondaries on other sites; the primary forwards every change to them in order, and when it dies
the first live secondary takes over and workers re-route their calls to it.

Wire format of a call: ``[gradient shard..., progress, op, tag]`` with op 0 = apply then reply,
1 = reply only (the final pull), 2 = leave (ps_sync); the reply is ``[parameters..., tag]``. The tag
is the server's version (updates applied): the worker sends back the version it last pulled (async:
its staleness; ps_sync: the step its push belongs to). Servers keep their shard and its optimiser
state in host memory (they serve Gloo pairs from threads); workers compute on their device and
stage gradients to pinned memory.
"""

from __future__ import annotations

import math
import struct
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cpn.runtime import faults
from cpn.runtime.config import PS_STRATEGIES, TrainConfig
from cpn.runtime.device import HOST
from cpn.runtime.strategies import ps_replicas
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
from cpn.runtime.strategies.ps_replicas import FWD_LEAVE, FWD_UPDATE, HEADER
from cpn.runtime.topology import Topology

OP_PUSH, OP_PULL, OP_LEAVE = 0.0, 1.0, 2.0
STALENESS = "cpn/ps/staleness"
NOT_SERVING = -1.0  # the version a replica that does not serve replies (versions count up from 0)


def primary_ranks(topology: Topology, count: int) -> list[int]:
    order = topology.leaders + [r for r in range(topology.world_size) if r not in topology.leaders]
    if count > len(order):
        raise ValueError(f"--ps {count} exceeds the {len(order)} ranks of the job: use at most {len(order)}")
    return order[:count]


def server_ranks(ctx: Context, count: int) -> list[int]:
    return primary_ranks(ctx.groups.topology, count)


def beside(fn: Any, *args: Any) -> Future:
    """``fn(*args)`` on a daemon thread. A call to a shard this process serves runs beside the remote ones: a
    ps_sync shard blocks until its step is applied, and a worker blocked there must not hold back its push
    to another shard (two workers each waiting on the other's next push stall every step to the timeout)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return future


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    size = -(-numel // shards)
    return [(k * size, min(numel, (k + 1) * size)) for k in range(shards)]


def check_ps(config: TrainConfig, topology: Topology) -> None:
    """The replica and PS-kill checks of :func:`cpn.runtime.train.preflight` (field paths in the messages)."""
    s = config.strategy
    primaries = primary_ranks(topology, min(s.ps, topology.world_size))
    ps_replicas.check(config, topology, primaries, PS_STRATEGIES)


def staleness_damping(workers: int, stale: int) -> float:
    """``min(1, N / (1 + s))``: 1 for a push as fresh as round-robin pushes of N workers, less when older."""
    return min(1.0, workers / (1 + max(0, stale)))


def as_sent(lr: float) -> float:
    """``lr`` rounded to float32, the precision of the forward stream: primary and secondaries step alike."""
    return struct.unpack("f", struct.pack("f", lr))[0]


class Server:
    """One replica of a parameter shard: the shard, its optimiser, a thread per remote worker, and the
    forward stream to the replicas after it (or from the ones before it, until it takes over)."""

    def __init__(self, ctx: Context, shard: int, theta: torch.Tensor, workers: int, index: int = 0):
        self.ctx, self.shard, self.index, self.workers = ctx, shard, index, workers
        self.param = torch.nn.Parameter(theta.to(HOST, copy=True))
        self.opt: torch.optim.Optimizer = torch.optim.AdamW(
            [self.param], lr=ctx.cfg.lr, betas=(0.9, 0.95), weight_decay=ctx.cfg.weight_decay)
        self.lr_scale = 1 / math.sqrt(workers)
        self.damping = ctx.cfg.strategy.ps_damping
        self.lock = threading.Lock()
        self.dead: set[int] = set()
        self.version = 0
        self.stale_sum = self.pushes = 0
        self.followers: list[dist.ProcessGroup] = []  # pairs to the replicas after this one, in order
        self.upstream = index  # replicas before this one still alive: it serves when none is left
        self.last: torch.Tensor | None = None  # the last change forwarded to this replica
        self.serving = threading.Event()
        if index == 0:
            self.serving.set()

    # -- the shard
    def _step(self, grad: torch.Tensor, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.param.grad = grad
        self.opt.step()
        self.version += 1

    def _forward(self, kind: float, payload: torch.Tensor, lr: float = 0.0, worker: int = -1) -> None:
        """Under the lock: hand this change to every secondary, in order, before any worker sees it."""
        if self.followers:
            head = torch.tensor([kind, lr, float(self.version), float(worker)], device=HOST)
            self._send(torch.cat([payload.reshape(-1), head]))

    def _send(self, msg: torch.Tensor) -> None:
        for pg in list(self.followers):
            try:
                pg.send([msg], 1, 0).wait()
                self.ctx.timers.wan_bytes += msg.numel() * msg.element_size()
            except Exception:  # noqa: BLE001 - that secondary is gone; the others still follow
                self.followers.remove(pg)

    def apply(self, grad: torch.Tensor, progress: float, seen: int) -> tuple[torch.Tensor, int]:
        """One worker's push, computed on version ``seen``: a (damped) AdamW step, forwarded."""
        with self.lock:
            stale = max(0, self.version - seen)
            self.stale_sum, self.pushes = self.stale_sum + stale, self.pushes + 1
            lr = lr_at(self.ctx.cfg, progress) * self.lr_scale
            if self.damping:
                lr *= staleness_damping(self.workers, stale)
            lr = as_sent(lr)
            self._step(grad, lr)
            self._forward(FWD_UPDATE, grad, lr)
            return self.param.detach().clone(), self.version

    def snapshot(self) -> tuple[torch.Tensor, int]:
        with self.lock:
            return self.param.detach().clone(), self.version

    def awaits_service(self) -> bool:
        """Wait (at most ``wan_timeout_seconds``) until this replica serves; False if it never did. A
        secondary whose primary is alive never serves: a worker that reached it only because its own
        link to the primary broke must hear so, not wait for ever."""
        return self.serving.wait(timeout=self.ctx.cfg.strategy.wan_timeout_seconds)

    def refusal(self) -> torch.Tensor:
        """The reply of a replica that does not serve: ``[zeros..., NOT_SERVING]`` (the caller moves on)."""
        return torch.cat([torch.zeros_like(self.param.detach()), torch.tensor([NOT_SERVING], device=HOST)])

    def handle(self, worker: int, grad: torch.Tensor, progress: float, op: float, tag: int) -> torch.Tensor:
        """One call, as the reply ``[parameters..., version]``; a secondary answers once it serves."""
        if not self.awaits_service():
            return self.refusal()
        params, version = self.apply(grad, progress, tag) if op == OP_PUSH else self.snapshot()
        return torch.cat([params, torch.tensor([float(version)], device=HOST)])

    def lost(self, worker: int) -> None:
        with self.lock:
            self.dead.add(worker)

    def left(self, worker: int) -> None:
        """A worker's leaving, replayed from the primary (ps_sync counts it; async_ps has no steps)."""

    # -- threads
    def serve(self, worker: int, push: dist.ProcessGroup, pull: dist.ProcessGroup) -> None:
        n = self.param.numel()
        while True:
            msg = torch.empty(n + 3, device=HOST)
            try:
                push.recv([msg], 0, 0).wait()
                progress, op, tag = msg[n:].tolist()
                pull.send([self.handle(worker, msg[:n], progress, op, int(tag))], 1, 0).wait()
            except Exception:  # noqa: BLE001 - the worker is gone
                self.lost(worker)
                return

    def follow(self, upstream: dist.ProcessGroup) -> None:
        """A secondary: replay what the replica before it forwards; serve when none before it is left."""
        n = self.param.numel()
        while True:
            msg = torch.empty(n + HEADER, device=HOST)
            try:
                upstream.recv([msg], 0, 0).wait()
            except Exception:  # noqa: BLE001 - that replica is gone
                break
            kind, lr, version, worker = msg[n:].tolist()
            with self.lock:
                if kind == FWD_UPDATE and int(version) == self.version + 1:
                    self._step(msg[:n].clone(), lr)
                elif kind == FWD_LEAVE:
                    self.left(int(worker))
                self.last = msg
        with self.lock:
            self.upstream -= 1
            if self.upstream == 0 and ps_replicas.record_failover(self, self.ctx.rank):
                self._take_over()

    def _take_over(self) -> None:
        """Under the lock: catch the replicas after this one up on the last change, then serve."""
        if self.last is not None:
            self._send(self.last)
        ps_replicas.dump(self, "promoted")
        self.serving.set()


class AsyncPS(Strategy):
    name = "async_ps"
    elastic = True
    global_budget = True

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        topo, world = ctx.groups.topology, ctx.groups.world_size
        self.servers_at = server_ranks(ctx, ctx.cfg.strategy.ps)
        self.replicas = [ps_replicas.replica_ranks(topo, p, ctx.cfg.strategy.ps_replicas) for p in self.servers_at]
        theta = flat_params(self.model)
        self.bounds = shard_bounds(theta.numel(), len(self.servers_at))
        self.route = [0] * len(self.bounds)  # which replica of each shard this worker calls
        self.tags = dict.fromkeys(range(len(self.bounds)), 0)
        self.budget = TokenBudget(ctx)
        self.stop = False
        self.local: dict[tuple[int, int], Server] = {}
        self.push: dict[tuple[int, int], dist.ProcessGroup] = {}
        self.pull: dict[tuple[int, int], dist.ProcessGroup] = {}
        timeout = timedelta(days=1)  # receivers block until a message comes; a dead peer closes the pair
        followers: list[tuple[Server, dist.ProcessGroup]] = []
        for k, ranks in enumerate(self.replicas):  # same order on every rank: no rendezvous deadlock
            lo, hi = self.bounds[k]
            for j, srank in enumerate(ranks):
                if ctx.rank == srank:
                    self.local[(k, j)] = self.make_server(k, theta[lo:hi], world, j)
                for w in range(world):
                    if w == srank or ctx.rank not in (w, srank):
                        continue
                    push = pair_group(ctx.store, f"ps{k}.{j}-push", w, srank, ctx.rank, timeout)
                    pull = pair_group(ctx.store, f"ps{k}.{j}-pull", srank, w, ctx.rank, timeout)
                    if ctx.rank == srank:
                        threading.Thread(target=self.local[(k, j)].serve, args=(w, push, pull), daemon=True).start()
                    else:
                        self.push[(k, j)], self.pull[(k, j)] = push, pull
            for i, src in enumerate(ranks):
                for j in range(i + 1, len(ranks)):
                    if ctx.rank not in (src, ranks[j]):
                        continue
                    pg = pair_group(ctx.store, f"ps{k}-fwd{i}.{j}", src, ranks[j], ctx.rank, timeout)
                    if ctx.rank == src:
                        self.local[(k, i)].followers.append(pg)
                    else:
                        followers.append((self.local[(k, j)], pg))
        for server, pg in followers:
            threading.Thread(target=server.follow, args=(pg,), daemon=True).start()
        self.primaries = {k for (k, j) in self.local if j == 0}

    def make_server(self, shard: int, theta: torch.Tensor, workers: int, index: int) -> Server:
        return Server(self.ctx, shard, theta, workers, index)

    def before_step(self, step: int) -> None:
        """``--kill-ps K --at-step N``: the process serving shard K's primary dies here, holding the shard's
        lock (no update after the saved state) -- the fail-over test compares the promoted secondary to it."""
        if faults.should_kill_ps(self.cfg.faults, self.primaries, step):
            faults.die([self._freeze_primaries])

    def _freeze_primaries(self) -> None:
        for k in sorted(self.primaries):
            server = self.local[(k, 0)]
            server.lock.acquire()  # held until the process exits
            ps_replicas.dump(server, "killed")

    def after_backward(self, step: int) -> None:
        ctx = self.ctx
        with ctx.timers.timed("compute"):
            grad = ctx.stage.out(torch.cat([g.reshape(-1) for g in grads_of(self.model)]))
            self.opt.zero_grad(set_to_none=False)
        spent = self.budget.add(ctx.step_tokens)
        self.progress = spent / self.budget.total
        self.stop = spent >= self.budget.total
        load_flat(self.model, self._rpc(grad, OP_PUSH))

    # -- calls to the servers, re-routed to the next replica when one is lost
    def _rpc(self, grad: torch.Tensor, op: float) -> torch.Tensor:
        theta = torch.empty(grad.numel(), device=HOST)
        shards = range(len(self.bounds))
        with self.ctx.timers.timed("comm"):
            calls = {k: self._start(k, grad, op) for k in shards}
            for k in shards:
                lo, hi = self.bounds[k]
                theta[lo:hi] = self._finish(k, grad, op, calls[k])
        return theta

    def _start(self, k: int, grad: torch.Tensor, op: float) -> Any:
        """Shard k's call to its current replica, in flight: a local call's future, a remote receive, or None (lost)."""
        lo, hi = self.bounds[k]
        j = self.route[k]
        server = self.local.get((k, j))
        if server is not None:
            return beside(server.handle, self.ctx.rank, grad[lo:hi], self.progress, op, self._tag(k))
        msg = torch.cat([grad[lo:hi], torch.tensor([self.progress, op, float(self._tag(k))], device=HOST)])
        out = torch.empty(hi - lo + 1, device=HOST)
        try:
            self.push[(k, j)].send([msg], 1, 0).wait()
            self._count(k, msg)
            return out, self.pull[(k, j)].recv([out], 0, 0)
        except Exception:  # noqa: BLE001 - the replica's process is gone
            return None

    def _tag(self, k: int) -> int:
        """The tag of a call to shard k: the version this worker last pulled from it (its staleness there)."""
        return self.tags[k]

    def _finish(self, k: int, grad: torch.Tensor, op: float, call: Any) -> torch.Tensor:
        """Shard k's reply; a replica that died before answering, or does not serve, passes the call on."""
        while True:
            reply = self._reply(call)
            if reply is not None and reply[-1].item() != NOT_SERVING:
                break
            self._fail_over(k)
            call = self._start(k, grad, op)
        self.tags[k] = int(reply[-1].item())
        return reply[:-1]

    @staticmethod
    def _reply(call: Any) -> torch.Tensor | None:
        if isinstance(call, Future):
            return call.result()
        if call is None:
            return None
        out, work = call
        try:
            work.wait()
        except Exception:  # noqa: BLE001 - the replica died before answering
            return None
        return out

    def _fail_over(self, k: int) -> None:
        self.route[k] += 1
        if self.route[k] >= len(self.replicas[k]):
            raise RuntimeError(f"every replica of parameter shard {k} is lost or does not serve (ranks {self.replicas[k]}): "
                               f"run with more --ps-replicas")

    def _count(self, k: int, msg: torch.Tensor) -> None:
        topo = self.ctx.groups.topology
        nbytes = msg.numel() * msg.element_size()
        if topo.site_of(self.replicas[k][self.route[k]]) == self.ctx.site:
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
        servers = list(self.local.values())
        ctx.store.add(f"{STALENESS}/sum", sum(s.stale_sum for s in servers))
        ctx.store.add(f"{STALENESS}/pushes", sum(s.pushes for s in servers))
        ctx.store.set(f"cpn/ps/done/{ctx.rank}", "1")
        patience = 4 * ctx.cfg.strategy.wan_timeout_seconds
        if ctx.rank == 0:
            deadline = time.monotonic() + patience
            for w in range(ctx.groups.world_size):
                while not ctx.store.check([f"cpn/ps/done/{w}"]) and time.monotonic() < deadline:
                    if any(w in s.dead for s in servers):
                        break
                    time.sleep(0.01)
            numel = sum(p.numel() for p in self.model.parameters())
            load_flat(self.model, self._rpc(torch.zeros(numel, device=HOST), OP_PULL))
            ctx.store.set(ps_replicas.RELEASED, "1")
            topo = ctx.groups.topology
            finished = [w for w in range(topo.world_size) if ctx.store.check([f"cpn/ps/done/{w}"])]
            self._live = sorted({topo.site_of(w) for w in finished})
        elif self.local:
            deadline = time.monotonic() + patience
            with ctx.timers.timed("wait"):
                while not ctx.store.check([ps_replicas.RELEASED]) and time.monotonic() < deadline:
                    time.sleep(0.01)

    _live: list[int] | None = None

    def live_sites(self) -> list[int]:
        if self._live is not None:
            return self._live
        topo = self.ctx.groups.topology
        dead = set().union(*(s.dead for s in self.local.values())) if self.local else set()
        return sorted({topo.site_of(r) for r in range(topo.world_size) if r not in dead})

    def summary_extras(self) -> dict[str, Any]:
        """Mean staleness of the pushes (as the servers counted them when their hosts finished) and the
        fail-overs: which replica of which shard took over, at which version."""
        store = self.ctx.store
        pushes = store.add(f"{STALENESS}/pushes", 0)
        mean = store.add(f"{STALENESS}/sum", 0) / pushes if pushes else 0.0
        return {"ps_staleness_mean": round(mean, 3), "ps_failovers": ps_replicas.failovers(store, len(self.bounds))}

    def site_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict()}

    def load_state(self, site_state: dict[str, Any] | None, global_state: dict[str, Any]) -> None:
        if site_state is not None:
            self.model.load_state_dict(site_state["model"])
