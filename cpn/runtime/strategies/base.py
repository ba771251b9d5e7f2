"""What every strategy shares: the worker context, the base protocol, and the cross-site plumbing.

A strategy owns one rank's optimiser(s) and everything it says to other ranks. The training loop
(:class:`cpn.train.Trainer`, the public API every job trains through) computes a micro-batch's gradients and hands over to
:meth:`Strategy.after_backward`; the strategy syncs, steps, and decides when the run ends.

Cross-site plumbing for the elastic strategies lives here:

- :class:`SiteExchange` averages a vector among the *live* site leaders. Every round the leaders
  check in on the job's TCPStore; site 0's leader (it hosts the store, so it outlives any other
  site) publishes the members, and whenever they change a fresh Gloo group is built on a
  ``PrefixStore(f"gen{g}")`` (the torchft way). A failed or timed-out exchange is recorded, the
  round falls back to the local vector, and the next round re-forms the group without the dead site.
- :class:`TokenBudget` is the job-wide token counter (``store.add``) that the barrier-free
  strategies stop on.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from pydantic import BaseModel
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from cpn.runtime.codecs import ErrorFeedback, get_codec
from cpn.runtime.collectives import Stats, broadcast_from_site_leader, site_allreduce
from cpn.runtime.config import PS_STRATEGIES, TrainConfig, trim_shares
from cpn.runtime.costmodel import (
    BALANCE_THRESHOLD as BALANCE_THRESHOLD,  # one source: the planner reads it too
)
from cpn.runtime.data import ShardSampler, canonical_picks
from cpn.runtime.device import HOST, HostStage
from cpn.runtime.groups import Groups
from cpn.runtime.metrics import Timers
from cpn.runtime.strategies.idle import IdleTrial, TrialState, shares_with_idle
from cpn.runtime.topology import Topology


@dataclass
class Context:
    """One worker's view of the job: config, groups, store, model, data, timers."""

    cfg: TrainConfig
    groups: Groups
    store: dist.Store
    model: nn.Module
    sampler: ShardSampler
    micro_batch: int
    timers: Timers = field(default_factory=Timers)
    shares: list[int] = field(default_factory=list)  # sequences per rank (empty: micro_batch everywhere)
    checkpoint_dir: Path | None = None
    val: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    bound_at: float = field(default_factory=time.perf_counter)  # when the worker took its device
    step_share: list[int] | None = None  # tokens per rank of a trimmed step (None: ``shares`` × seq_len)
    busy_seconds: float = 0.0  # forward + backward (and any injected slow-down): what sets a rank's speed
    sequences_done: int = 0
    step_walls: list[float] = field(default_factory=list)  # each step's wall seconds, evaluations excluded
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None  # the pipeline's last stage, for a user's model
    cuts: list[int] | None = None  # the pipeline: where a user's model is cut (None: by parameter count)

    @property
    def device(self) -> torch.device:
        return self.groups.device

    @property
    def stage(self) -> HostStage:
        """Device <-> pinned host copies for the Gloo groups that cross the WAN."""
        return self.groups.stage or HostStage(self.device)

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def site(self) -> int:
        return self.groups.site

    @property
    def num_sites(self) -> int:
        return self.groups.S

    @property
    def is_leader(self) -> bool:
        return self.groups.is_leader

    @property
    def step_tokens(self) -> int:
        """This rank's tokens in the current step."""
        return self.tokens_of(self.rank)

    def share_of(self, rank: int) -> int:
        return self.shares[rank] if self.shares else self.micro_batch

    def tokens_of(self, rank: int) -> int:
        """``rank``'s tokens in the current step (its share of a full step, or of the trimmed last one)."""
        return self.step_share[rank] if self.step_share is not None else self.share_of(rank) * self.cfg.seq_len

    def window_picks(self) -> tuple[list[tuple[int, int]], list[int]]:
        """This rank's windows of the current step as (shard, index) picks of the step's canonical
        layout (equal shares, what ddp reads), and each shard's draw size: throughput-proportional
        shares move windows between ranks, the step still learns from ddp's windows
        (:func:`~cpn.runtime.data.canonical_picks`)."""
        n, seq_len = self.groups.world_size, self.cfg.seq_len
        units = [self.tokens_of(r) for r in range(n)]
        equal = self.cfg.shares(n)
        canonical = [s * seq_len for s in equal] if self.step_share is None else trim_shares(sum(units), equal, seq_len)
        return canonical_picks(units, canonical, self.rank, seq_len)

    def site_sequences(self, site: int) -> int:
        return sum(self.share_of(r) for r in self.groups.topology.ranks_of(site))

    @property
    def site_step_tokens(self) -> int:
        return sum(self.tokens_of(r) for r in self.groups.topology.ranks_of(self.site))

    def world_weight(self) -> tuple[int, int]:
        """This rank's gradient weight in a world average, as (numerator, denominator)."""
        total = sum(self.tokens_of(r) for r in range(self.groups.world_size))
        return self.step_tokens * self.groups.world_size, total

    def site_weight(self) -> tuple[int, int]:
        return self.step_tokens * self.groups.site_size, self.site_step_tokens

    def account(self, stats: Stats) -> None:
        self.timers.intra_bytes += stats.intra_bytes
        self.timers.wan_bytes += stats.wan_bytes


# ----------------------------------------------------------------------------- tensor helpers
def params_of(model: nn.Module) -> list[Tensor]:
    return [p for p in model.parameters()]


def _local(p: Tensor) -> Tensor:
    """This rank's part of a parameter: the local shard of a sharded (DTensor) one, else the whole."""
    return p.to_local() if isinstance(p, DTensor) else p


def flat_params(model: nn.Module) -> Tensor:
    """The parameters this rank holds, as one vector (under ``shard="site"``: its shards only)."""
    return torch.cat([_local(p).detach().reshape(-1) for p in model.parameters()]).clone()


@torch.no_grad()
def load_flat(model: nn.Module, vec: Tensor) -> None:
    offset = 0
    for p in model.parameters():
        t = _local(p)
        n = t.numel()
        t.copy_(vec[offset : offset + n].view_as(t))
        offset += n


def grads_of(model: nn.Module) -> list[Tensor]:
    out = []
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(p.grad)
    return out


def make_optimizer(cfg: TrainConfig, params: list[Tensor], lr: float | None = None) -> torch.optim.Optimizer:
    lr = cfg.lr if lr is None else lr
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr)
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def lr_at(cfg: TrainConfig, progress: float) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    progress = min(max(progress, 0.0), 1.0)
    if cfg.warmup_fraction and progress < cfg.warmup_fraction:
        return cfg.lr * (progress / cfg.warmup_fraction + 1e-3)
    span = (progress - cfg.warmup_fraction) / max(1e-9, 1 - cfg.warmup_fraction)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * span)))


def weigh(tensors: list[Tensor], weight: tuple[int, int]) -> None:
    """Scale by ``num/den`` before an averaging all-reduce, so that ranks with uneven shares of the
    batch count by the sequences they did (no-op when the shares are equal). A rank of weight 0 (no
    sequences: idle, or out of a trimmed step) sends zeros, whatever its loop computed: 0 × NaN is NaN,
    and a user's loop may have run its model on an empty batch."""
    num, den = weight
    if num == 0 or not den:
        torch._foreach_zero_(tensors)
    elif num != den:
        torch._foreach_mul_(tensors, num / den)


def timed_barrier(ctx: Context, group: dist.ProcessGroup | None) -> None:
    """A one-element all-reduce: the time spent here is waiting for slower peers, not moving data."""
    if group is None or dist.get_world_size(group) == 1:
        return
    with ctx.timers.timed("wait"):
        dist.all_reduce(torch.zeros(1, device=HOST), group=group)  # a host scalar: Gloo on every level


def site_sync_grads(ctx: Context) -> None:
    """Average gradients inside the site (the fast network), every step; a sharded model's were
    reduce-scattered in backward already (weighted through :meth:`Strategy.loss_weight`)."""
    if ctx.groups.site_size == 1 or isinstance(ctx.model, FSDPModule):
        return
    timed_barrier(ctx, ctx.groups.intra)
    grads = grads_of(ctx.model)
    weigh(grads, ctx.site_weight())
    with ctx.timers.timed("comm"):
        ctx.account(site_allreduce(grads, ctx.groups, op="avg"))


def site_broadcast(ctx: Context, tensors: list[Tensor]) -> None:
    if ctx.groups.site_size == 1:
        return
    with ctx.timers.timed("comm"):
        ctx.account(broadcast_from_site_leader(tensors, ctx.groups))


def site_values(ctx: Context, *values: float) -> list[float]:
    """The site leader's numbers, on every rank of the site (so the site decides as one)."""
    if ctx.groups.site_size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=HOST)
    with ctx.timers.timed("comm"):
        dist.broadcast(t, src=ctx.groups.leader_rank, group=ctx.groups.intra)
    return t.tolist()


def proportional_shares(total: int, speeds: list[float]) -> list[int]:
    """``total`` sequences split in proportion to ``speeds``, at least one each (largest remainder)."""
    n = len(speeds)
    weights = [max(s, 1e-9) for s in speeds]
    raw = [total * w / sum(weights) for w in weights]
    shares = [max(1, int(r)) for r in raw]
    while sum(shares) > total:
        i = max((k for k in range(n) if shares[k] > 1), key=lambda k: shares[k] - raw[k])
        shares[i] -= 1
    while sum(shares) < total:
        i = max(range(n), key=lambda k: raw[k] - shares[k])
        shares[i] += 1
    return shares


# steps after which the balanced strategies re-measure every rank's speed and re-split the batch: a
# quick first split, a longer second one, then every BALANCE_EVERY steps over the steps since the last
# split, so the shares follow speeds that drift (a shared machine, thermal limits, a site's other jobs)
BALANCE_WINDOWS = ((1, 5), (5, 12), (12, 25))
BALANCE_EVERY = 25


def balance_window(step: int) -> tuple[int | None, int | None]:
    """(whether ``step`` ends a measuring window: its start, else None; whether one starts at ``step``:
    ``step``, else None) under :data:`BALANCE_WINDOWS` and :data:`BALANCE_EVERY`."""
    last = BALANCE_WINDOWS[-1][1]
    ends = {end: start for start, end in BALANCE_WINDOWS}
    starts = {start for start, _ in BALANCE_WINDOWS}
    if step >= last and (step - last) % BALANCE_EVERY == 0:
        starts.add(step)
        if step > last:
            ends[step] = step - BALANCE_EVERY
    return ends.get(step), step if step in starts else None


def speed_classes(speeds: list[float], threshold: float = BALANCE_THRESHOLD) -> list[float]:
    """``speeds`` with each rank's replaced by the mean of its class: ranks sorted by speed, a class
    runs while a speed is within ``threshold`` of the class's slowest. Two equal sites measured 10 %
    apart (the noise of one window on a shared CPU) then take equal shares instead of 15 and 13 of 32
    sequences, which made every step wait for the one that drew the larger."""
    order = sorted(range(len(speeds)), key=lambda r: speeds[r])
    out = list(speeds)
    start = 0
    for i in range(1, len(order) + 1):
        if i == len(order) or speeds[order[i]] > threshold * speeds[order[start]]:
            members = order[start:i]
            mean = sum(speeds[r] for r in members) / len(members)
            for r in members:
                out[r] = mean
            start = i
    return out


# ----------------------------------------------------------------------------- strategy protocol
class Strategy:
    """Base protocol; the default is 'site-synchronous local training' (what diloco/gossip share)."""

    name: ClassVar[str] = ""
    elastic: ClassVar[bool] = False
    global_budget: ClassVar[bool] = False
    balanced: ClassVar[bool] = False  # may give ranks shares of the batch by measured speed (strategy.balance)
    may_idle: ClassVar[bool] = False  # balanced, and synchronous every step: may try its slowest ranks idle (idle.py)
    owns_forward_backward: ClassVar[bool] = False  # the loop calls :meth:`forward_backward` instead of its own
    takes_inputs: bool = False  # owns the passes and takes the user's rows (trainer.step(inputs=, targets=))

    @classmethod
    def check(cls, cfg: TrainConfig, topology: Topology, *, builtin_model: bool = True) -> None:
        """Refuse, before any worker starts, a config this strategy cannot run on ``topology``
        (a ValueError that says how to fix it); :func:`cpn.runtime.train.preflight` calls it.
        ``builtin_model``: the job trains CPN's built-in LM (False: a user's code builds its model)."""

    @classmethod
    def survives(cls, cfg: TrainConfig, topology: Topology) -> bool:
        """Whether the job goes on without a lost site (the live sites finish it), for ``cfg`` as resolved
        on ``topology``; :func:`cpn.runtime.strategies.survives_site_loss` asks it for the orchestrator."""
        return cls.elastic

    def __init__(self, ctx: Context):
        self.ctx, self.cfg, self.model = ctx, ctx.cfg, ctx.model
        self.sharded = isinstance(self.model, FSDPModule)  # shard="site": FSDP2 over the site (sharding.py)
        self.opt = make_optimizer(self.cfg, params_of(self.model))
        self.start_step = 0
        self.progress = 0.0
        self.idle_trial = IdleTrial()

    # the loop calls these, in this order, every step
    def before_step(self, step: int) -> None:
        """Hook for strategies that gate a step (ssp's staleness bound)."""

    def plan_step(self, step: int) -> None:
        """Each rank's tokens in ``step``: its share of the global batch, or of what is left of the budget
        in the trimmed last step (:func:`~cpn.runtime.config.trim_shares`), so the job trains exactly
        ``cfg.tokens``. The parameter-server family counts its budget at the servers (async_ps.py)."""
        ctx, cfg = self.ctx, self.cfg
        tokens = cfg.step_tokens(step)
        full = self.name in PS_STRATEGIES or tokens >= cfg.global_batch_tokens or tokens <= 0
        world = range(ctx.groups.world_size)
        ctx.step_share = None if full else trim_shares(tokens, [ctx.share_of(r) for r in world], cfg.seq_len)

    def loss_weight(self) -> float:
        """What the loop scales this rank's loss by before backward: 1, except on a sharded model, whose
        site reduce-scatter (an equal average, in backward) must count each rank by its tokens as
        :func:`weigh` does for the others: by its share of the site's tokens (diloco, local_sgd), or
        of the job's when the gradients are averaged across sites too (ddp, hierarchical)."""
        if not self.sharded:
            return 1.0
        num, den = self.ctx.world_weight() if self.name in ("ddp", "hierarchical") else self.ctx.site_weight()
        return num / den if den else 0.0

    def set_lr(self, step: int) -> None:
        if not self.global_budget:
            self.progress = self.cfg.tokens_through(step) / self.cfg.tokens
        lr = lr_at(self.cfg, self.progress)
        for group in self.opt.param_groups:
            group["lr"] = lr

    def forward_backward(self, step: int) -> float | None:
        """This rank's forward and backward passes of ``step`` when the strategy schedules them itself
        (``owns_forward_backward``: the pipeline's micro-batches); the loss, or None without tokens.
        The loop books the call's time as compute; a strategy that waits inside moves that to ``wait``."""
        raise NotImplementedError(f"{self.name} does not own the forward/backward pass")

    def gather(self, step: int) -> None:
        """Bring the whole model to rank 0 (the pipeline; every other strategy holds it whole already)."""

    def after_backward(self, step: int) -> None:
        site_sync_grads(self.ctx)
        if self.ctx.site_step_tokens:  # a site with no tokens in a trimmed step keeps its parameters
            self._inner_step()

    def should_stop(self, step: int) -> bool:
        limit = self.cfg.total_steps if self.cfg.stop_at_step is None else min(self.cfg.total_steps, self.cfg.stop_at_step)
        return step >= limit

    def finish(self, step: int) -> None:
        """Bring the model to its final (consensus) state; rank 0 evaluates it afterwards."""

    def rebalance(self, step: int) -> None:
        """Throughput-proportional shares (``strategy.balance``): after ``step`` steps, at the ends of
        :data:`BALANCE_WINDOWS` and every :data:`BALANCE_EVERY` steps after them, every rank posts its speed over the window (sequences per busy second)
        on the job's store and all take the same new split of the global batch, so a synchronous step
        takes as long everywhere instead of waiting for the slowest. The weighted averages follow
        the shares. A rank that does not post within ``wan_timeout_seconds`` leaves the split as it was,
        and later windows no longer wait for it (a dead site would otherwise cost the timeout every window);
        it keeps the mean speed of the others, so the live ranks' split still follows their speeds. The
        ranks of sites the WAN exchange has dropped (:func:`dropped_sites`) are not waited for at all:
        the exchange already waited the timeout for them, so a dead site costs it once, not once more
        here (a dropped site that posts anyway counts; one that checks in again is waited for again).
        Which ranks count and which were missing is decided once per window on the store (the first
        rank to finish waiting writes it, the others read it and stop waiting), so every rank takes the
        same split."""
        if not (self.balanced and self.cfg.strategy.balance) or self.sharded:  # a site's ranks shard one model: equal shares
            return
        ctx = self.ctx
        ended, started = balance_window(step)
        window = getattr(self, "_window", None)
        walls = list(ctx.step_walls)  # the steps since the last window's end or start
        if ended is not None or started is not None:
            del ctx.step_walls[:]
        if started is not None:
            self._window = (ctx.busy_seconds, ctx.sequences_done)
        if ended is None or window is None:
            return
        busy, seqs = ctx.busy_seconds - window[0], ctx.sequences_done - window[1]
        store = dist.PrefixStore("cpn/balance", ctx.store)
        store.set(f"{step}/{ctx.rank}/wall", repr(statistics.median(walls) if walls else 0.0))  # read after the speed
        store.set(f"{step}/{ctx.rank}", repr(seqs / max(busy, 1e-9)))
        world = ctx.groups.world_size
        silent: set[int] = getattr(self, "_silent", set())
        dropped = dropped_ranks(ctx)
        keys = {r: f"{step}/{r}" for r in range(world) if r not in silent}
        awaited = {r: k for r, k in keys.items() if r not in dropped}
        verdict_key = f"{step}/verdict"
        with ctx.timers.timed("wait"):
            wait_keys(store, list(awaited.values()), time.monotonic() + self.cfg.strategy.wan_timeout_seconds,
                      settled=verdict_key)
        present = {r for r, k in keys.items() if store.check([k])}
        mine = BalanceVerdict(counted=sorted(present), missing=sorted(set(awaited) - present))
        verdict = BalanceVerdict.model_validate_json(store.compare_set(verdict_key, "", mine.model_dump_json()))
        self._silent = silent | set(verdict.missing)  # the first verdict stands
        if verdict.missing or not verdict.counted:
            return
        trial = self.idle_trial
        posted = {r: float(store.get(f"{step}/{r}")) for r in verdict.counted}
        mean = sum(posted.values()) / len(posted)
        speeds = trial.speeds_with_idle([posted.get(r, mean) for r in range(world)])
        if max(speeds) <= BALANCE_THRESHOLD * min(speeds):  # equal hardware: noise, not a straggler
            trial.stop()
            ctx.shares = self.cfg.shares(world)
        else:
            classes = speed_classes(speeds)
            idle = trial.next_idle(classes, self._window_rate(store, step, verdict.counted)) \
                if self.may_idle else frozenset()
            ctx.shares = shares_with_idle(self.cfg.global_sequences, classes, idle, proportional_shares)
        trial.uneven = ctx.shares != self.cfg.shares(world)
        ctx.micro_batch = ctx.shares[ctx.rank]

    def _window_rate(self, store: dist.Store, step: int, ranks: list[int]) -> float:
        """The job's sequences per second of training in the window ending at ``step``, from the ranks'
        posted median step times: a median, as a step that waited out an evaluation or a hiccup of a
        shared host would move a mean; the least of them, as rank 0's skip its evaluations."""
        walls = [w for r in ranks if (w := float(store.get(f"{step}/{r}/wall"))) > 0]
        return self.cfg.global_sequences / min(walls) if walls else 0.0

    def publish(self) -> None:
        """Every rank, when the job closes (after the loop's last validation, before its final figures):
        post what :meth:`summary_extras` reads from the other ranks."""

    def summary_extras(self) -> dict[str, Any]:
        """Strategy-specific figures for the run summary (rank 0, after every rank's :meth:`publish`);
        under balanced shares, the last split of the global batch (``shares``: sequences per rank)."""
        if self.balanced and self.cfg.strategy.balance and self.ctx.shares:
            extras: dict[str, Any] = {"shares": list(self.ctx.shares)}
            trial = self.idle_trial
            if trial.tries:  # ranks tried idle, and whether it stood (idle.py); ready again after a no
                extras["idle_trial"] = (TrialState.DROPPED if trial.state is TrialState.READY else trial.state).value
                if trial.gain is not None:
                    extras["idle_gain"] = round(trial.gain, 3)
            return extras
        return {}

    def live_sites(self) -> list[int]:
        return list(range(self.ctx.num_sites))

    # checkpoints
    def checkpoint_due(self, step: int) -> bool:
        every = self.cfg.checkpoint_every
        return bool(every) and self.ctx.checkpoint_dir is not None and step % every == 0

    def site_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

    def shares_state_with(self, site: int) -> bool:
        """Whether another site's checkpoint file may stand in for this site's missing one (None: the
        site rejoins from the global state)."""
        return False

    def global_state(self) -> dict[str, Any]:
        return {}

    def load_state(self, site_state: dict[str, Any] | None, global_state: dict[str, Any]) -> None:
        if site_state is not None:
            self.model.load_state_dict(site_state["model"])
            self.opt.load_state_dict(site_state["opt"])

    # sharded checkpoints (shard="site", checkpoint.save_sharded / load_sharded)
    def sharded_state(self) -> dict[str, Any]:
        """This rank's shards of its site's model and optimiser, under ``site<K>``."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, opt = get_state_dict(self.model, self.opt)
        return {f"site{self.ctx.site}": {"model": model, "optim": opt}}

    def sharded_template(self, sites: list[int]) -> dict[str, Any]:
        """What :meth:`sharded_state` would hold now, keyed by the site whose state this rank takes
        (its own, or site 0's when the checkpoint has none of this site)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, opt = get_state_dict(self.model, self.opt)
        source = self.ctx.site if self.ctx.site in sites else sites[0]
        return {f"site{source}": {"model": model, "optim": opt}}

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        (part,) = [v for k, v in state.items() if k.startswith("site")]
        set_state_dict(self.model, self.opt, model_state_dict=part["model"], optim_state_dict=part["optim"])

    def _inner_step(self) -> None:
        with self.ctx.timers.timed("compute"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)


# ----------------------------------------------------------------------------- job-wide state
class TokenBudget:
    """The job's shared token counter: barrier-free strategies stop when it reaches the budget."""

    def __init__(self, ctx: Context):
        self.store = dist.PrefixStore("cpn/budget", ctx.store)
        self.total = ctx.cfg.tokens

    def add(self, tokens: int) -> int:
        return self.store.add("tokens", tokens)

    def spent(self) -> int:
        return self.store.add("tokens", 0)


def wait_keys(store: dist.Store, keys: list[str], deadline: float, poll: float = 0.01,
              settled: str | None = None) -> list[str]:
    """Poll until every key exists, the deadline passes or the key ``settled`` exists (someone has
    decided already); returns the keys that exist."""
    while True:
        present = [k for k in keys if store.check([k])]
        done = len(present) == len(keys) or (settled is not None and store.check([settled]))
        if done or time.monotonic() >= deadline:
            return present
        time.sleep(poll)


class BalanceVerdict(BaseModel):
    """A balance window's outcome, decided once on the store: the ranks whose speeds count, and the
    ranks waited for that did not post (then the split stays as it was)."""

    counted: list[int]
    missing: list[int]


def dropped_sites(store: dist.Store, exchange: str = "wan") -> set[int]:
    """The sites the latest check-in of the exchange named ``exchange`` dropped (not arrived within
    ``wan_timeout_seconds``, or silent since an exchange that failed): nothing waits for them until
    they check in again."""
    key = f"cpn/{exchange}/{SiteExchange.DROPPED}"
    return set(json.loads(store.get(key))) if store.check([key]) else set()


def dropped_ranks(ctx: Context) -> set[int]:
    """The ranks of :func:`dropped_sites`."""
    sites = dropped_sites(ctx.store)
    return {r for s in sites for r in ctx.groups.topology.ranks_of(s)} if sites else set()


class PendingAverage:
    """An exchange in flight; :meth:`wait` returns the average (on the host), or None when the
    exchange failed."""

    def __init__(self, exchange: SiteExchange, rnd: int, x: Tensor, work: Any = None,
                 outs: list[Tensor] | None = None):
        self.exchange, self.round, self.x, self.work, self.outs = exchange, rnd, x, work, outs

    def wait(self) -> Tensor | None:
        ex = self.exchange
        if self.work is None:
            return self.x
        since = time.monotonic()
        try:
            with ex.ctx.timers.timed("comm"):
                self.work.wait(ex.timeout)
        except Exception as exc:  # noqa: BLE001 - a dead peer surfaces as any of several errors
            ex.record_failure(self.round, exc, since)
            return None
        if self.outs is None:
            return self.x.div_(len(ex.members))
        n = self.x.numel()
        return sum(ex.codec.decode(w, ex.padded(n))[:n] for w in self.outs) / len(self.outs)


def host_copy(stage: HostStage, x: Tensor) -> Tensor:
    """A float32 host copy of ``x`` that the caller may modify (Gloo's input)."""
    host = stage.out(x.detach().float())
    return host.clone() if host.data_ptr() == x.data_ptr() else host


class SiteExchange:
    """Averages one vector across the live sites' leaders, re-forming the group on membership change.

    A site that does not check in within ``wan_timeout_seconds`` is dropped from the members, and the
    coordinator records the dropped sites on the store (:func:`dropped_sites`, read by the balance
    windows), so a dead site costs the job one timeout. After an exchange that failed, the members
    that recorded the failure are alive and are waited for as ever; one that did not (the site whose
    death failed it) is waited for only until ``wan_timeout_seconds`` after the coordinator's failed
    exchange began waiting (it already waited for it there), not a whole timeout more."""

    DROPPED = "dropped"  # the store key (under the exchange's prefix) of the latest check-in's dropped sites

    def __init__(self, ctx: Context, name: str = "wan", *, sites: list[int] | None = None,
                 compression: str | None = None, weighted: bool = True):
        """``sites``: the sites that exchange (default every site; the first coordinates: it must be the
        one that outlives the others); ``compression``: the codec (default ``strategy.compression``);
        ``weighted``: weigh each site's vector by its share of the batch."""
        self.ctx = ctx
        self.store = dist.PrefixStore(f"cpn/{name}", ctx.store)
        self.site = ctx.site
        self.sites = list(range(ctx.num_sites)) if sites is None else list(sites)
        self.coordinator = self.sites[0]
        self.members = list(self.sites)
        self.weighted = weighted
        self.gen = -1
        self.pg: dist.ProcessGroup | None = None
        self.timeout = timedelta(seconds=ctx.cfg.strategy.wan_timeout_seconds)
        self.codec = get_codec(ctx.cfg.strategy.compression if compression is None else compression)
        self.ef = ErrorFeedback() if self.codec is not None else None
        self.failed: tuple[int, float] | None = None  # this site's last failed exchange: (round, when its wait began)

    def padded(self, n: int) -> int:
        align = self.codec.align if self.codec else 1
        return -(-n // align) * align

    def record_failure(self, rnd: int, exc: BaseException, since: float) -> None:
        """Round ``rnd``'s exchange failed after waiting for the members from ``since`` (monotonic)."""
        self.store.set(f"r{rnd}/failed/{self.site}", repr(exc)[:200])
        self.failed = (rnd, since)
        self.pg = None

    def join(self, rnd: int) -> bool:
        """Check in for round ``rnd``; True when this site takes part in the exchange."""
        self.store.set(f"r{rnd}/arrive/{self.site}", "1")
        if self.site == self.coordinator:
            self._decide(rnd)
        with self.ctx.timers.timed("wait"):
            decision = json.loads(self.store.get(f"r{rnd}/members"))
        members, gen = decision["members"], decision["gen"]
        if self.site not in members:
            return False
        if gen != self.gen or self.pg is None:
            self.members, self.gen = members, gen
            self.pg = self._build(rnd) if len(members) > 1 else None
            if self.pg is None and len(members) > 1:
                return False
        return True

    def _decide(self, rnd: int) -> None:
        everyone = [f"r{rnd}/arrive/{s}" for s in self.sites]
        with self.ctx.timers.timed("wait"):
            self._await_members(rnd)
        arrived = sorted(int(k.rsplit("/", 1)[1]) for k in everyone if self.store.check([k]))
        failed = rnd > 0 and any(self.store.check([f"r{rnd - 1}/failed/{s}"]) for s in self.members)
        gen = self.gen
        if arrived != self.members or failed or gen < 0:
            gen = max(gen, 0) + (0 if self.gen < 0 and arrived == self.members else 1)
        dropped = sorted(set(self.sites) - set(arrived))
        self.store.set(self.DROPPED, json.dumps(dropped))  # before the members: who reads them may read this
        self.store.set(f"r{rnd}/members", json.dumps({"gen": gen, "members": arrived}))

    def _await_members(self, rnd: int, poll: float = 0.01) -> None:
        """Wait for the members' check-ins of round ``rnd``: ``wan_timeout_seconds`` from now, except
        for a member silent since this site's exchange of the previous round failed (it recorded no
        failure of its own): ``wan_timeout_seconds`` from when that exchange began waiting for it, so
        the exchange and the check-in together wait one timeout for it (none here after a time-out)."""
        start, patience = time.monotonic(), self.timeout.total_seconds()
        since = self.failed[1] if self.failed is not None and self.failed[0] == rnd - 1 else None

        def deadline(site: int) -> float:
            if since is None or self.store.check([f"r{rnd - 1}/failed/{site}"]):
                return start + patience
            return since + patience

        while True:
            waiting = [s for s in self.members if not self.store.check([f"r{rnd}/arrive/{s}"])]
            if not any(time.monotonic() < deadline(s) for s in waiting):
                return
            time.sleep(poll)

    def _build(self, rnd: int) -> dist.ProcessGroup | None:
        prefixed = dist.PrefixStore(f"gen{self.gen}", self.store)
        since = time.monotonic()
        try:
            with self.ctx.timers.timed("wait"):
                return dist.ProcessGroupGloo(prefixed, self.members.index(self.site), len(self.members), self.timeout)
        except Exception as exc:  # noqa: BLE001 - a member died between the decision and the rendezvous
            self.record_failure(rnd, exc, since)
            return None

    def start(self, rnd: int, x: Tensor) -> PendingAverage:
        """Begin averaging ``x`` (flat) over the members; the caller may compute meanwhile.

        The group is Gloo, so what it moves is on the host: the float32 vector, or the wire of a
        codec that encodes (with its error feedback) on ``x``'s device."""
        stage = self.ctx.stage
        if self.pg is not None and self.weighted:  # by the sites' shares of the batch (equal sites: no-op)
            mine, total = self.ctx.site_sequences(self.site) * len(self.members), sum(
                self.ctx.site_sequences(s) for s in self.members)
            x = x if mine == total else x * (mine / total)
        if self.pg is None or self.codec is None:
            host = host_copy(stage, x)
            if self.pg is None:
                return PendingAverage(self, rnd, host)
            m = len(self.members)
            self.ctx.timers.wan_bytes += 2 * (m - 1) * host.numel() * 4 // m
            return PendingAverage(self, rnd, host, work=self.pg.allreduce([host]))
        m = len(self.members)
        n = x.numel()
        buf = torch.zeros(self.padded(n), device=x.device)
        buf[:n] = x.detach()
        if self.ef is not None:
            buf = self.ef.compensate("x", buf)
        wire = self.codec.encode(buf)
        if self.ef is not None:
            self.ef.record("x", buf, self.codec.decode(wire, buf.numel()))
        wire = stage.out(wire)
        x = host_copy(stage, x) if stage.active else x.detach().float()
        outs = [torch.empty_like(wire) for _ in range(m)]
        self.ctx.timers.wan_bytes += (m - 1) * wire.numel()
        return PendingAverage(self, rnd, x, work=self.pg.allgather([outs], [wire]), outs=outs)
