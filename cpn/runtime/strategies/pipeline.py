"""``pipeline``: the model cut into one contiguous stage per site, micro-batches fed through 1F1B.

Model parallel across sites (seed 002's 流水线): site s holds stage s of the layers (cut by
parameter count, :mod:`cpn.runtime.stages`); only the activations at a cut cross the WAN forward,
and their gradients backward, point to point between consecutive sites (``isend``/``recv`` on the
world group). Inside a site the ranks are data parallel: local rank j of every stage works on the
j-th share of the step's sequences, and after the step the stage's gradients are averaged over the
site's fast network. The first and last stage hold the two copies of the tied token table and add
their gradients (one WAN exchange of ``vocab x d`` per step), so the run is the same optimisation
as one process training the whole model (a test holds it to that).

Stage 0's local rank j reads the j-th of W shards of the whole training corpus (as W data-parallel
workers of a one-site job would), and sends the targets to the last stage. Each rank splits its
share into ``strategy.micro_batches`` micro-batches and runs the 1F1B schedule: stage s starts with
``P-1-s`` forwards, then alternates one forward and one backward, then drains the backwards, so at most ``P-s`` micro-batches' activations are held at once. The
idle time of a rank during the schedule (waiting for a neighbour's activations or gradients, the
bubble plus the WAN transfer) is measured and reported as ``bubble_fraction``; the ideal bubble with
free links is ``(P-1)/(M+P-1)``. ``strategy.compression`` (fp16/bf16/int8, default none) encodes
what crosses a cut in both directions.

Replicas (``stages`` P below the job's S sites, S = D·P): sites d·P … d·P+P−1 run replica d of the
whole pipeline on its 1/D of each step's sequences (stage 0's local rank j of replica d reads shard
d·W+j of D·W). The replicas of a stage combine as local SGD does (``strategy.inner_steps`` H): every
H steps and at the end, each stage's parameters are averaged over its D copies (the site leaders'
ring all-reduce of the stage, counted as ``wan_replica_bytes``, then a broadcast inside each site);
with H = 1 the replicas instead average the stage's gradients every step (token-weighted), the same
optimisation as one process training the whole batch. Validations between averagings evaluate
replica 0's model. H unset: :func:`cpn.runtime.autotune.replica_inner_steps`, the smallest H that
keeps the averaging within 10 % of the bytes the cuts move.

Losing a site. With one replica, or D ≥ 2 averaged every step (H = 1), the whole job stops (its
collectives fail) and the orchestrator re-places it from the last checkpoint, as for any synchronous
job. With D ≥ 2 and H > 1 (:meth:`Pipeline.survives`) the others continue: each stage's copies average
through an elastic exchange among the stage's site leaders (:class:`SiteExchange` over the sites
``s, P+s, …``, coordinated by replica 0's), which drops a copy that does not check in within
``wan_timeout_seconds``. The replica that lost a site breaks: its live ranks see their point-to-point
exchanges with the dead site fail, stop training, and leave cleanly, which in turn fails their
neighbours' exchanges, so the whole replica leaves; the next averaging drops it and the remaining
replicas train on, sharing every step between them from the next averaging on (rank 0's view of the
live replicas, agreed on the store), so the budget is trained to its end; what the lost replica trained
since the last averaging is lost with it. Replica 0 holds rank 0 (the job's store, validation and final weights): when it loses a
site, its ranks fail and the job restarts from its checkpoint as before.

A user's ``nn.Sequential`` (``spec.code``, through :meth:`cpn.train.Job.wrap` with ``loss_fn``) is cut
the same way, its children being the units (:mod:`cpn.runtime.stages`). Its data come from the user's
loop: stage 0's ranks pass each step's ``inputs`` and ``targets`` to ``trainer.step``; stage 0 tells
every later stage of its chain how many micro-batches the step has and sends the targets to the last
stage, which computes the user's ``loss_fn`` (a mean over the micro-batch's rows, weighted by its rows).
Shapes and dtypes are not known in advance, so each activation goes with a small header (dtype and
shape) on its own tag; floating-point tensors cross as float32 (or the codec), others as their bytes.

Validation runs through the stages (:meth:`Pipeline.evaluate`, the built-in LM's loop calls it on
every rank): rank 0 feeds the validation batches to stage 0, replica 0's site leaders each run their
stage forward, the activations cross each cut as in training (with the job's codec) and the targets go
to the last stage, which sends the mean loss back to rank 0. No stage's parameters leave their site to
validate: what crosses is counted as ``wan_eval_bytes``, apart from the training traffic. Only at the
end (and when a user's loop calls ``trainer.gather()`` before evaluating its own model on rank 0) does
every later stage's leader send its parameters to rank 0, for the final weights; counted the same way.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from cpn.runtime import catalogue, checkpoint
from cpn.runtime.codecs import get_codec
from cpn.runtime.collectives import site_allreduce, wan_allreduce
from cpn.runtime.config import TrainConfig, trim_shares
from cpn.runtime.data import ShardSampler, load_data, split_corpus
from cpn.runtime.device import HOST, autocast
from cpn.runtime.stages import LMUnits, Stage, cut_units, units_of
from cpn.runtime.strategies.base import Context, SiteExchange, Strategy, make_optimizer, site_broadcast, weigh
from cpn.runtime.topology import Topology

__all__ = ["Pipeline", "feeder_shard", "ideal_bubble"]

TIED_TAG, TARGET_TAG, GATHER_TAG, STEP_TAG, EVAL_COUNT_TAG, EVAL_LOSS_TAG = 1, 2, 3, 4, 5, 6
MICRO_TAG = 16  # micro-batch i's activations go with tag MICRO_TAG + 2i, their gradients with MICRO_TAG + 2i + 1
HEADER_TAG = 1 << 20  # a user model's activation i: its header (dtype, shape) with tag HEADER_TAG + i
EVAL_TAG = 1 << 21  # validation batch i: its shape with tag EVAL_TAG + 3i, activations + 1, targets + 2
MAX_DIMS = 8  # dimensions a header can describe
DESC = 3 + MAX_DIMS  # a tensor's description: dtype, ndim, whether a gradient comes back, the dims
WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
               torch.int8, torch.uint8, torch.bool)
STATS_KEY = "cpn/pipeline"
LIVE_KEY = "cpn/pipeline-live"  # + "/{round}": the replicas stage 0's averaging held, as rank 0 saw them
REPLICA_TIMEOUT_SECONDS = 1800.0  # how long a stage's leader waits for the other replicas' copies


class PeerLost(RuntimeError):
    """A point-to-point exchange with another stage, or the site's own collective, failed: a peer is gone."""


@contextmanager
def _wire() -> Iterator[None]:
    """What fails inside is a peer lost (errors of the computation itself stay what they are)."""
    try:
        yield
    except PeerLost:
        raise
    except Exception as exc:  # noqa: BLE001 - a dead peer surfaces as any of several errors
        raise PeerLost(f"{type(exc).__name__}: {str(exc)[:200]}") from exc


def feeder_shard(cfg: TrainConfig, topology: Topology, site: int, local_rank: int) -> tuple[int, int]:
    """Which of how many data shards a rank at ``site`` reads: only the first stage's ranks read data,
    D replicas × W per site of them, local rank j of replica d the shard d·W + j (a later stage's rank
    gets its first-stage peer's shard)."""
    stages, replicas = cfg.strategy.pipeline_shape(topology.num_sites)
    width = topology.workers_per_site
    return (site // stages) * width + local_rank, replicas * width


def ideal_bubble(stages: int, micro_batches: int) -> float:
    """The idle fraction of a 1F1B (or GPipe) schedule on free links: (P-1)/(M+P-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def micro_sizes(tokens: int, seq_len: int, micro_batches: int) -> list[tuple[int, int]]:
    """``tokens`` as micro-batches of (sequences, length): whole sequences in up to ``micro_batches``
    near-equal parts, then the partial sequence of a trimmed step on its own."""
    n, tail = divmod(tokens, seq_len)
    m = min(micro_batches, n)
    out = [(n // m + (1 if i < n % m else 0), seq_len) for i in range(m)] if m else []
    return out + ([(1, tail)] if tail else [])


@dataclass
class PipeStats:
    idle: float = 0.0
    schedule: float = 0.0
    activation_bytes: int = 0
    gradient_bytes: int = 0
    eval_bytes: int = 0
    replica_bytes: int = 0


class Pipeline(Strategy):
    name = "pipeline"
    owns_forward_backward: ClassVar[bool] = True

    @classmethod
    def check(cls, cfg: TrainConfig, topology: Topology, *, builtin_model: bool = True) -> None:
        from cpn.runtime.presets import resolve

        sites, (stages, _) = topology.num_sites, cfg.strategy.pipeline_shape(topology.num_sites)
        if stages > sites or sites % stages:
            raise ValueError(f"strategy.stages {stages} must divide the job's {sites} sites (one stage per site, "
                             f"each replica of the pipeline on {stages} sites): drop stages or set a divisor of {sites}")
        if not topology.is_uniform:
            raise ValueError(f"pipeline needs the same number of workers at every site, got "
                             f"{[s.ranks for s in topology.sites]}: even out the sites")
        units = resolve(cfg.model).n_layers + 2
        if builtin_model and stages > units:  # a user's model is checked when it is wrapped
            raise ValueError(f"model {cfg.model!r} has {units} units (embedding, {units - 2} blocks, head), too few "
                             f"for {stages} stages: use a deeper model or fewer sites")

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        topo = ctx.groups.topology
        self.check(self.cfg, topo)
        self.P, self.D = self.cfg.strategy.pipeline_shape(topo.num_sites)
        self.W, self.local = topo.workers_per_site, ctx.groups.local_rank
        self.replica = ctx.site // self.P
        self.H = self.cfg.strategy.inner_steps or 1
        self.units = units_of(self.model)
        self.builtin = isinstance(self.units, LMUnits)
        if len(self.units) < self.P:
            raise ValueError(f"the model has {len(self.units)} units ({', '.join(self.units.names())}), too few for "
                             f"{self.P} stages: use fewer stages (strategy.stages) or split the model further")
        self.cuts = cut_units(self.units, self.P, ctx.cuts)
        self.stage = Stage(self.units, self.cuts[self.s])
        self.params = self.stage.params()
        self.opt = make_optimizer(self.cfg, self.params)
        self.codec = get_codec(self.cfg.strategy.compression)
        self.stats = PipeStats()
        self.d_model = self.model.cfg.d_model if self.builtin else 0
        self.my_rows = 0
        self.loss_fn: Callable[[Tensor, Tensor], Tensor] | None = ctx.loss_fn
        if not self.builtin and self.loss_fn is None:
            raise ValueError("the pipeline computes the loss at the last stage: pass loss_fn to job.wrap "
                             "(e.g. loss_fn=nn.CrossEntropyLoss())")
        self.feed: tuple[Tensor | None, Tensor | None] = (None, None)
        self.takes_inputs = not self.builtin and self.stage.has_embed
        if self.stage.has_embed and self.builtin:  # the stage's ranks split the whole corpus (the worker's own sampler has 1/world)
            train = split_corpus(load_data(self.cfg)).train
            shard, shards = feeder_shard(self.cfg, topo, ctx.site, self.local)
            self.sampler = ShardSampler(train, shard=shard, num_shards=shards, seq_len=self.cfg.seq_len,
                                        seed=self.cfg.seed)
        self.my_tokens = self.stage_tokens = self.step_tokens = 0
        self._gathered = self._averaged = -1
        self.survivable = self.survives(self.cfg, topo)
        self.broken = False  # this rank's replica lost a site: it stops training and leaves
        self.live_replicas = list(range(self.D))  # as this stage's last averaging saw them
        self._rounds = 0
        self.copies = None if self.survivable else self._replica_group(topo)
        self.exchange = SiteExchange(ctx, f"pipeline-stage{self.s}", sites=[d * self.P + self.s for d in range(self.D)],
                                     compression="none", weighted=False) if self.survivable and ctx.is_leader else None

    def shares_state_with(self, site: int) -> bool:
        """Site ``site``'s checkpoint file holds this site's stage (every replica's copy of it does): a
        site without its own file — its replica left the run — resumes from a live replica's copy."""
        return site % self.P == self.s

    @classmethod
    def survives(cls, cfg: TrainConfig, topology: Topology) -> bool:
        """D ≥ 2 replicas averaged every H > 1 steps: a replica that loses a site stops, the others go on
        (the rule lives in the torch-free catalogue, which the orchestrator reads too)."""
        return catalogue.survives(cfg, topology)

    def _replica_group(self, topo: Topology) -> dist.ProcessGroup | None:
        """This site leader's group with the same stage's leaders in every replica (every rank builds
        every group, in the same order, as torch.distributed requires). The ranks of a site hold the
        same stage, so only the leaders cross the WAN. Between averagings the replicas run apart (a
        slower one arrives H slow steps later), hence a generous timeout: a lost site stops the job anyway."""
        if self.D == 1:
            return None
        mine = None
        timeout = timedelta(seconds=max(REPLICA_TIMEOUT_SECONDS, 4 * self.cfg.strategy.wan_timeout_seconds))
        for stage in range(self.P):
            ranks = [topo.leader_rank(d * self.P + stage) for d in range(self.D)]
            group = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if self.ctx.rank in ranks:
                mine = group
        return mine

    # ------------------------------------------------------------------ peers
    def _peer(self, stage: int) -> int:
        return self.ctx.groups.topology.global_rank(self.replica * self.P + stage, self.local)

    @property
    def s(self) -> int:
        """This site's stage (its place in its replica of the pipeline)."""
        return self.ctx.site % self.P

    # ------------------------------------------------------------------ the step
    def plan_step(self, step: int) -> None:
        """Every stage's local rank j of the i-th live replica takes the (i·W+j)-th share of the step (the
        live replicas as the last averaging agreed; all D at first); the tokens are reported by stage 0's
        ranks only (each token is trained once, by one whole pipeline)."""
        ctx, cfg, topo = self.ctx, self.cfg, self.ctx.groups.topology
        live = self.live_replicas
        per_rank = trim_shares(cfg.step_tokens(step), cfg.shares(len(live) * self.W), cfg.seq_len)
        at = live.index(self.replica) if self.replica in live else None
        mine = [0] * self.W if at is None else per_rank[at * self.W:(at + 1) * self.W]
        self.my_tokens, self.stage_tokens, self.step_tokens = mine[self.local], sum(mine), sum(per_rank)
        share = [0] * ctx.groups.world_size
        for i, d in enumerate(live):
            for j, r in enumerate(topo.ranks_of(d * self.P)):
                share[r] = per_rank[i * self.W + j]
        ctx.step_share = share

    def forward_backward(self, step: int) -> float | None:
        if self.broken:
            return None
        try:
            return self._schedule(step)
        except PeerLost as exc:
            self._break(exc)
            return None

    def _break(self, exc: PeerLost) -> None:
        """A point-to-point exchange of this replica failed: a site of it is gone. Under
        :meth:`survives` (not replica 0) this rank stops training and leaves cleanly, its site's leader
        telling the checkpoints not to wait for its replica's sites; otherwise the error stands and the
        job restarts from its checkpoint."""
        if not self.survivable or self.replica == 0:
            raise exc
        self.broken = True
        if self.ctx.is_leader:
            for stage in range(self.P):
                checkpoint.leave(self.ctx.store, self.replica * self.P + stage)
        print(f"cpn: pipeline replica {self.replica} lost a site ({exc}); site {self.ctx.site} stops and the "
              f"other replicas go on", flush=True)

    def _schedule(self, step: int) -> float | None:
        t0 = time.perf_counter()
        self._idle = 0.0
        self._sends: list[tuple[Any, Tensor]] = []
        if self.builtin:
            micro = micro_sizes(self.my_tokens, self.cfg.seq_len, self.cfg.strategy.micro_batches)
            if not micro:
                return None
            xs, ys = self._inputs(step, micro)
        else:
            xs, ys, micro = self._user_inputs()
            if not micro:
                self._wait_sends()
                return None
        held: dict[int, tuple[Tensor, Tensor]] = {}
        losses: list[float] = []
        m, warm = len(micro), min(self.P - 1 - self.s, len(micro))
        order = [("f", i) for i in range(warm)]
        for i in range(m - warm):
            order += [("f", warm + i), ("b", i)]
        order += [("b", i) for i in range(m - warm, m)]
        for kind, i in order:
            if kind == "f":
                held[i] = self._forward(i, micro[i], xs, ys, losses)
            else:
                self._backward(i, micro[i], *held.pop(i))
        self._wait_sends()
        elapsed = time.perf_counter() - t0
        self.stats.idle += self._idle
        self.stats.schedule += elapsed
        self.ctx.timers.add("compute", -self._idle)  # the loop books the whole call as compute
        self.ctx.timers.add("wait", self._idle)
        return sum(losses) if self.stage.has_head else None

    def _inputs(self, step: int, micro: list[tuple[int, int]]) -> tuple[list[Tensor], list[Tensor]]:
        """Stage 0: this step's token windows cut into micro-batches; the last stage: their targets
        (sent by stage 0, one byte per token for byte vocabularies)."""
        rows = sum(b for b, t in micro)
        xs: list[Tensor] = []
        y: Tensor | None = None
        if self.stage.has_embed:
            x, y = (t.to(self.ctx.device) for t in self.sampler.batch(step, rows))
            xs = _split(x, micro)
            if not self.stage.has_head:
                wire = y.to(self.target_dtype).cpu()
                self._send(wire, self._peer(self.P - 1), TARGET_TAG, "activation")
        elif self.stage.has_head:
            wire = torch.empty((rows, self.cfg.seq_len), dtype=self.target_dtype, device=HOST)
            self._recv(wire, self._peer(0), TARGET_TAG)
            y = wire.long().to(self.ctx.device)
        return xs, (_split(y, micro) if self.stage.has_head and y is not None else [])

    def _user_inputs(self) -> tuple[list[Tensor], list[Tensor], list[tuple[int, int]]]:
        """A user model's step: stage 0 cuts the fed rows into micro-batches and tells every later stage of
        its chain how many (and the last stage the targets' dtype and shape, then the targets)."""
        header = torch.zeros(1 + DESC, dtype=torch.int64)
        xs: list[Tensor] = []
        y: Tensor | None = None
        if self.stage.has_embed:
            x, y = self.feed
            self.feed = (None, None)
            rows = 0 if x is None else int(x.shape[0])
            if rows and (y is None or int(y.shape[0]) != rows):
                raise ValueError(f"trainer.step(inputs=..., targets=...): {rows} rows of inputs need as many rows of "
                                 f"targets, got {None if y is None else tuple(y.shape)}")
            m = min(self.cfg.strategy.micro_batches, rows)
            xs = list(torch.tensor_split(x.to(self.ctx.device), m)) if m else []
            header[0] = m
            if m:
                _describe(header[1:], y)
            for stage in range(1, self.P):
                self._send(header.clone(), self._peer(stage), STEP_TAG, "activation")
            if m and self.P > 1:
                self._send(_bytes_of(y), self._peer(self.P - 1), TARGET_TAG, "activation")
        else:
            self._recv(header, self._peer(0), STEP_TAG)
            m = int(header[0])
            if m and self.stage.has_head:
                y = self._recv_described(header[1:], self._peer(0), TARGET_TAG)
        ys = list(torch.tensor_split(y.to(self.ctx.device), m)) if m and self.stage.has_head and y is not None else []
        rows = int(y.shape[0]) if y is not None and m else 0
        self.my_rows = rows
        micro = [(int(t.shape[0]), 1) for t in ys] if ys else [(0, 1)] * m
        return xs, ys, micro

    def _recv_described(self, header: Tensor, src: int, tag: int) -> Tensor:
        dtype, shape = _described(header)
        n = math.prod(shape)
        wire = torch.empty(n * _itemsize(dtype), dtype=torch.uint8, device=HOST)
        self._recv(wire, src, tag)
        return wire.view(dtype).view(shape)

    @property
    def target_dtype(self) -> torch.dtype:
        return torch.uint8 if self.model.cfg.vocab_size <= 256 else torch.int32

    def _forward(self, i: int, shape: tuple[int, int], xs: list[Tensor], ys: list[Tensor],
                 losses: list[float]) -> tuple[Tensor, Tensor]:
        if not self.builtin:
            return self._user_forward(i, xs, ys, losses)
        if self.stage.has_embed:
            inp = xs[i]
        else:
            inp = self._recv_tensor((*shape, self.d_model), self._peer(self.s - 1), MICRO_TAG + 2 * i)
            inp.requires_grad_(True)
        with autocast(self.ctx.device, self.cfg.device.precision):
            out = self.stage(inp)
            if self.stage.has_head:
                out = self.stage.loss(out, ys[i]) * (shape[0] * shape[1] / self.my_tokens)
        if self.stage.has_head:
            losses.append(out.item())
        else:
            self._send_tensor(out.detach(), self._peer(self.s + 1), MICRO_TAG + 2 * i, "activation")
        return inp, out

    def _user_forward(self, i: int, xs: list[Tensor], ys: list[Tensor], losses: list[float]) -> tuple[Tensor, Tensor]:
        if self.stage.has_embed:
            inp = xs[i]
        else:
            header = torch.zeros(DESC, dtype=torch.int64)
            self._recv(header, self._peer(self.s - 1), HEADER_TAG + i)
            inp = self._recv_activation(header, self._peer(self.s - 1), MICRO_TAG + 2 * i)
            if _wants_grad(header):  # the stage before waits for this input's gradient (and only then)
                inp.requires_grad_(True)
        with autocast(self.ctx.device, self.cfg.device.precision):
            out = self.stage(inp)
            if self.stage.has_head:
                out = self.loss_fn(out, ys[i]) * (ys[i].shape[0] / self.my_rows)  # type: ignore[misc]
        if self.stage.has_head:
            losses.append(out.item())
        else:
            header = torch.zeros(DESC, dtype=torch.int64)
            _describe(header, out)
            self._send(header, self._peer(self.s + 1), HEADER_TAG + i, "activation")
            if out.is_floating_point():
                self._send_tensor(out.detach(), self._peer(self.s + 1), MICRO_TAG + 2 * i, "activation")
            else:
                self._send(_bytes_of(out), self._peer(self.s + 1), MICRO_TAG + 2 * i, "activation")
        return inp, out

    def _recv_activation(self, header: Tensor, src: int, tag: int) -> Tensor:
        dtype, shape = _described(header)
        if dtype.is_floating_point:
            return self._recv_tensor(shape, src, tag).to(dtype)
        return self._recv_described(header, src, tag).to(self.ctx.device)

    def _backward(self, i: int, shape: tuple[int, int], inp: Tensor, out: Tensor) -> None:
        """Backward through the stage: a gradient comes from the next stage exactly when this stage's
        output needed one (its header said so), and one goes back exactly when the input did (zeros if
        nothing in the stage reached it): both ends of every cut agree, so neither waits in vain."""
        if out.requires_grad:
            if self.stage.has_head:
                out.backward()
            else:
                grad = self._recv_tensor(tuple(out.shape), self._peer(self.s + 1), MICRO_TAG + 2 * i + 1)
                torch.autograd.backward(out, grad_tensors=grad.to(out.dtype))
        if not self.stage.has_embed and inp.requires_grad:
            grad = inp.grad if inp.grad is not None else torch.zeros_like(inp)
            self._send_tensor(grad, self._peer(self.s - 1), MICRO_TAG + 2 * i + 1, "gradient")

    # ------------------------------------------------------------------ the wire
    def _padded(self, n: int) -> int:
        align = self.codec.align if self.codec else 1
        return -(-n // align) * align

    def _send_tensor(self, t: Tensor, dst: int, tag: int, kind: str) -> None:
        flat = t.detach().float().reshape(-1).cpu()
        if self.codec is not None:
            buf = torch.zeros(self._padded(flat.numel()), device=HOST)
            buf[: flat.numel()] = flat
            flat = self.codec.encode(buf)
        self._send(flat.contiguous(), dst, tag, kind)

    def _recv_tensor(self, shape: tuple[int, ...], src: int, tag: int) -> Tensor:
        n = math.prod(shape)
        if self.codec is None:
            buf = torch.empty(n, device=HOST)
            self._recv(buf, src, tag)
            return buf.view(shape).to(self.ctx.device)
        wire = torch.empty(self.codec.wire_bytes(self._padded(n)), dtype=torch.uint8, device=HOST)
        self._recv(wire, src, tag)
        return self.codec.decode(wire, self._padded(n))[:n].view(shape).to(self.ctx.device)

    def _send(self, t: Tensor, dst: int, tag: int, kind: str) -> None:
        nbytes = t.numel() * t.element_size()
        self.ctx.timers.wan_bytes += nbytes
        if kind == "activation":
            self.stats.activation_bytes += nbytes
        elif kind == "gradient":
            self.stats.gradient_bytes += nbytes
        else:
            self.stats.eval_bytes += nbytes
        with _wire():
            self._sends.append((dist.isend(t, dst, tag=tag), t))

    def _recv(self, t: Tensor, src: int, tag: int) -> None:
        t0 = time.perf_counter()
        with _wire():
            dist.recv(t, src, tag=tag)
        self._idle += time.perf_counter() - t0

    def _wait_sends(self) -> None:
        t0 = time.perf_counter()
        with _wire():
            for work, _ in self._sends:
                work.wait()
        self._sends = []
        self._idle += time.perf_counter() - t0

    # ------------------------------------------------------------------ after the schedule
    def after_backward(self, step: int) -> None:
        if self.broken:
            return
        try:
            self._sync_and_step(step)
        except PeerLost as exc:  # the tied table's exchange, or the site's all-reduce, with a dead peer
            self._break(exc)

    def should_stop(self, step: int) -> bool:
        return self.broken or super().should_stop(step)

    def checkpoint_due(self, step: int) -> bool:
        return not self.broken and super().checkpoint_due(step)

    def live_sites(self) -> list[int]:
        """The sites of the replicas this stage's last averaging held (rank 0: stage 0's view)."""
        return sorted(d * self.P + s for d in self.live_replicas for s in range(self.P))

    def _sync_and_step(self, step: int) -> None:
        ctx = self.ctx
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.W > 1:
            grads = [p.grad for p in self.params]
            weigh(grads, (self.my_tokens * self.W, self.stage_tokens))
            with ctx.timers.timed("comm"), _wire():
                ctx.account(site_allreduce(grads, ctx.groups, op="avg"))
        if self.stage.ties_embedding:
            self._sum_tied_grad()
        if self.D > 1 and self.H == 1:
            self._average_grads()
        if self.stage_tokens or (self.D > 1 and self.H == 1 and self.step_tokens):
            self._inner_step()
        done = step + 1
        if self.D > 1 and self.H > 1 and done % self.H == 0:
            self._average(done)

    # ------------------------------------------------------------------ across replicas
    def _replica_allreduce(self, tensors: list[Tensor], scale: float) -> None:
        """``tensors`` × ``scale``, summed over this stage's copies in the D replicas: a ring across the
        sites' leaders, then a broadcast inside each site (its ranks hold the same stage)."""
        if self.copies is not None:
            torch._foreach_mul_(tensors, scale)
            with self.ctx.timers.timed("comm"):
                stats = wan_allreduce(tensors, self.ctx.groups, group=self.copies, key="replicas")
            self.ctx.account(stats)
            self.stats.replica_bytes += stats.wan_bytes
        site_broadcast(self.ctx, tensors)

    def _average_grads(self) -> None:
        """H = 1: the stage's gradients, token-weighted over the replicas (each replica's are its mean)."""
        self._replica_allreduce([p.grad for p in self.params],
                                self.stage_tokens / self.step_tokens if self.step_tokens else 0.0)

    def _average(self, done: int) -> None:
        """Local SGD across replicas: each stage's parameters become the mean of its D copies."""
        if done == self._averaged or self.broken:
            return
        self._averaged = done
        if self.survivable:
            self._exchange_average([p.data for p in self.params])
        else:
            self._replica_allreduce([p.data for p in self.params], 1.0 / self.D)

    def _exchange_average(self, params: list[Tensor]) -> None:
        """The stage's copies in the live replicas averaged through the elastic exchange (site leaders),
        then broadcast inside the site; a copy the exchange dropped keeps its own parameters this round."""
        rnd, self._rounds = self._rounds, self._rounds + 1
        if self.exchange is not None:
            before = self.ctx.timers.wan_bytes
            mean = self.exchange.start(rnd, flat_params_of(params)).wait() if self.exchange.join(rnd) else None
            self.stats.replica_bytes += self.ctx.timers.wan_bytes - before
            if mean is not None:
                _load(params, mean)
                self.live_replicas = sorted(m // self.P for m in self.exchange.members)
        site_broadcast(self.ctx, params)
        self._agree_on_replicas(rnd)

    def _agree_on_replicas(self, rnd: int) -> None:
        """Every rank of the live replicas takes rank 0's view of them after round ``rnd``, so that the
        stages of a replica split the next steps alike: the live replicas share every step between
        them, and the budget is trained to its end without the ones that broke."""
        key = f"{LIVE_KEY}/{rnd}"
        if self.ctx.rank == 0:
            self.ctx.store.set(key, json.dumps(self.live_replicas))
        self.live_replicas = json.loads(self.ctx.store.get(key))

    def _sum_tied_grad(self) -> None:
        """First and last stage add their gradients of the token table (a + b == b + a exactly)."""
        grad = self.model.tok.weight.grad
        peer = self._peer(self.P - 1 if self.stage.has_embed else 0)
        incoming = torch.empty(grad.numel(), device=HOST)
        self._sends, self._idle = [], 0.0
        with self.ctx.timers.timed("comm"):
            self._send(grad.detach().float().reshape(-1).cpu().clone(), peer, TIED_TAG, "gradient")
            self._recv(incoming, peer, TIED_TAG)
            self._wait_sends()
        grad.add_(incoming.view_as(grad).to(grad.device, grad.dtype))

    def gather(self, step: int) -> None:
        """Every later stage's parameters to rank 0, whose whole model the loop evaluates."""
        if step == self._gathered or self.P == 1:
            return
        self._gathered = step
        self._gather_to_rank0()

    def _gather_to_rank0(self) -> None:
        ctx, self._sends, self._idle = self.ctx, [], 0.0
        with ctx.timers.timed("comm"):
            if ctx.rank == 0:
                for cut in self.cuts[1:]:
                    owned = Stage(self.units, cut).owned_params()
                    flat = torch.empty(sum(p.numel() for p in owned), device=HOST)
                    self._recv(flat, self._peer_leader(cut.index), GATHER_TAG)
                    _load(owned, flat)
            elif ctx.is_leader and self.s > 0 and self.replica == 0:
                self._send(flat_params_of(self.stage.owned_params()), 0, GATHER_TAG, "eval")
                self._wait_sends()

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def evaluate(self, batches: list[tuple[Tensor, Tensor]]) -> float | None:
        """The built-in LM's mean loss over ``batches`` (rank 0's validation windows), computed through
        replica 0's stages: rank 0 feeds them, each stage's site leader runs its stage, the last sends the
        mean back. Every rank calls it (the others return at once); rank 0 gets the loss (NaN without
        batches), every other rank None. The stages' parameters stay where they are. The activations cross
        with the job's codec, as in training's forward: with int8 on the cuts the loss is the pipeline's
        as it runs, not the whole model's in one process (float32 would move four times the bytes)."""
        ctx = self.ctx
        if self.replica != 0 or not ctx.is_leader:
            return None
        self._sends, self._idle = [], 0.0
        if self.P == 1:
            loss: float | None = self._eval_local(batches)
        elif self.s == 0:
            loss = self._eval_feed(batches)
        else:
            self._eval_relay()
            loss = None
        self._wait_sends()
        return loss

    def _eval_local(self, batches: list[tuple[Tensor, Tensor]]) -> float:
        losses = []
        for x, y in batches:
            with autocast(self.ctx.device, self.cfg.device.precision):
                losses.append(self.stage.loss(self.stage(x.to(self.ctx.device)), y.to(self.ctx.device)).item())
        return sum(losses) / len(losses) if losses else float("nan")

    def _eval_feed(self, batches: list[tuple[Tensor, Tensor]]) -> float:
        """Stage 0: the batch count to every later stage, then each batch's shape, its activations to stage
        1 and its targets to the last stage; finally the last stage's mean loss."""
        later = [self._peer(stage) for stage in range(1, self.P)]
        for peer in later:
            self._send(torch.tensor([len(batches)], dtype=torch.int64, device=HOST), peer, EVAL_COUNT_TAG, "eval")
        for i, (x, y) in enumerate(batches):
            shape = torch.tensor(list(x.shape), dtype=torch.int64, device=HOST)
            for peer in later:
                self._send(shape.clone(), peer, EVAL_TAG + 3 * i, "eval")
            with autocast(self.ctx.device, self.cfg.device.precision):
                out = self.stage(x.to(self.ctx.device))
            self._send_tensor(out, self._peer(1), EVAL_TAG + 3 * i + 1, "eval")
            self._send(y.to(self.target_dtype).cpu().contiguous(), self._peer(self.P - 1), EVAL_TAG + 3 * i + 2, "eval")
            self._wait_sends()  # one window's activations in flight at a time: host memory stays one batch's
        loss = torch.empty(1, dtype=torch.float64, device=HOST)
        self._recv(loss, self._peer(self.P - 1), EVAL_LOSS_TAG)
        return float(loss) if batches else float("nan")

    def _eval_relay(self) -> None:
        """A later stage: each batch's activations through this stage, on to the next; the last stage
        computes the loss against the targets stage 0 sent and returns the mean to rank 0."""
        count = torch.empty(1, dtype=torch.int64, device=HOST)
        self._recv(count, self._peer(0), EVAL_COUNT_TAG)
        losses = []
        for i in range(int(count)):
            shape = torch.empty(2, dtype=torch.int64, device=HOST)
            self._recv(shape, self._peer(0), EVAL_TAG + 3 * i)
            rows, length = (int(v) for v in shape)
            inp = self._recv_tensor((rows, length, self.d_model), self._peer(self.s - 1), EVAL_TAG + 3 * i + 1)
            with autocast(self.ctx.device, self.cfg.device.precision):
                out = self.stage(inp)
            if not self.stage.has_head:
                self._send_tensor(out, self._peer(self.s + 1), EVAL_TAG + 3 * i + 1, "eval")
                self._wait_sends()
                continue
            y = torch.empty((rows, length), dtype=self.target_dtype, device=HOST)
            self._recv(y, self._peer(0), EVAL_TAG + 3 * i + 2)
            losses.append(self.stage.loss(out, y.long().to(self.ctx.device)).item())
        if self.stage.has_head:
            mean = sum(losses) / len(losses) if losses else float("nan")
            self._send(torch.tensor([mean], dtype=torch.float64, device=HOST), self._peer(0), EVAL_LOSS_TAG, "eval")

    def _peer_leader(self, stage: int) -> int:
        return self.ctx.groups.topology.leader_rank(stage)

    def finish(self, step: int) -> None:
        if self.broken:
            return
        if self.D > 1 and self.H > 1:
            self._average(step)
        self.gather(step)

    def publish(self) -> None:
        """This rank's schedule and byte counts, the last validation's included."""
        record = {"idle": self.stats.idle, "schedule": self.stats.schedule, "activation": self.stats.activation_bytes,
                  "gradient": self.stats.gradient_bytes, "eval": self.stats.eval_bytes,
                  "replica": self.stats.replica_bytes}
        self.ctx.store.set(f"{STATS_KEY}/{self.ctx.rank}", json.dumps(record))

    def summary_extras(self) -> dict[str, Any]:
        store = self.ctx.store  # the ranks that published (the loop waited for the live ones' final figures)
        ranks = [r for r in range(self.ctx.groups.world_size) if store.check([f"{STATS_KEY}/{r}"])]
        records = [json.loads(store.get(f"{STATS_KEY}/{r}")) for r in ranks]
        schedule = sum(r["schedule"] for r in records)
        names = self.units.names()
        m = min(self.cfg.strategy.micro_batches, max(1, self.cfg.shares(self.D * self.W)[-1]))
        return {
            "bubble_fraction": round(sum(r["idle"] for r in records) / schedule, 4) if schedule else None,
            "bubble_ideal": round(ideal_bubble(self.P, m), 4),
            "micro_batches": m,
            "stages": [[names[u] for u in range(c.start, c.end)] for c in self.cuts],
            "wan_activation_bytes": sum(r["activation"] for r in records),
            "wan_gradient_bytes": sum(r["gradient"] for r in records),
            "wan_eval_bytes": sum(r["eval"] for r in records),
            "replicas": self.D,
            "live_replicas": self.live_replicas if self.survivable else list(range(self.D)),
            "inner_steps": self.H if self.D > 1 else None,
            "wan_replica_bytes": sum(r["replica"] for r in records),
        }


def _describe(header: Tensor, t: Tensor) -> None:
    """``header`` (int64) = [dtype code, ndim, dims …] of ``t``."""
    if t.dtype not in WIRE_DTYPES or t.dim() > MAX_DIMS:
        raise ValueError(f"the pipeline sends tensors of up to {MAX_DIMS} dimensions of "
                         f"{', '.join(str(d).removeprefix('torch.') for d in WIRE_DTYPES)} between stages, "
                         f"not {t.dtype} of shape {tuple(t.shape)}")
    header[0], header[1], header[2] = WIRE_DTYPES.index(t.dtype), t.dim(), int(t.requires_grad)
    for k, size in enumerate(t.shape):
        header[3 + k] = size


def _described(header: Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    ndim = int(header[1])
    return WIRE_DTYPES[int(header[0])], tuple(int(v) for v in header[3 : 3 + ndim])


def _wants_grad(header: Tensor) -> bool:
    return bool(int(header[2]))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bytes_of(t: Tensor) -> Tensor:
    """A tensor's bytes on the host (what crosses for integer tensors and targets)."""
    flat = t.detach().reshape(-1).cpu().contiguous()
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)


def _split(t: Tensor, micro: list[tuple[int, int]]) -> list[Tensor]:
    out, row = [], 0
    for b, length in micro:
        out.append(t[row : row + b, :length])
        row += b
    return out


def flat_params_of(params: list[Tensor]) -> Tensor:
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in params])


@torch.no_grad()
def _load(params: list[Tensor], flat: Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(flat[offset : offset + n].view_as(p).to(p.device, p.dtype))
        offset += n
