"""WAN-aware all-reduce over torch.distributed: one entry point, three algorithms.

``allreduce(tensors, algorithm=...)`` reduces in place and returns :class:`Stats`, the bytes this
rank sent intra-site and across the WAN by the algorithm's own count (ring collectives send
2(P-1)/P of the buffer per rank; measured counters in :mod:`cpn.runtime.accounting` cross-check it).

- ``flat``: torch's all-reduce over every rank (what DDP gives).  Ranks are numbered site by site, so
  the ring crosses the WAN S times and each crossing carries 2(N-1)/N of the buffer.
- ``hierarchical`` (2D torus): intra-site reduce-scatter, then each of the W same-local-rank groups
  all-reduces its 1/W shard across sites in parallel, then intra-site all-gather.  Each site sends
  2(S-1)/S of the buffer over the WAN — the lower bound — spread over its W workers.
- ``leader``: intra-site reduce to the leader, all-reduce among leaders, intra-site broadcast.
- ``multilevel`` (BlueConnect-style, one level per link class): reduce-scatter inside the site, then
  reduce-scatter among the sites of the region (metro links), all-reduce across regions (long-haul,
  1/(W*R) of the buffer per worker), then all-gather back down.  Levels of one rank drop out, so
  with every site its own region it moves what ``hierarchical`` moves.  Compression is per level:
  ``multilevel+int8`` compresses the slowest level, ``multilevel+fp16/int8`` metro fp16, long-haul int8.

Compression (``fp16``/``bf16``/``int8``/``int4``/``topk``) applies to the WAN leg only (to everything for ``flat``,
which has no separate leg).  A compressed all-reduce over P ranks is an ``all_to_all`` of encoded
1/P parts, a float32 sum of the parts each rank owns, and an ``all_gather`` of the re-encoded sums:
2(P-1)/P of the *encoded* buffer per rank, so int8 sends 1/4 (+1/64 for scales) of float32.
The same path carries top-k, which is not additive on the wire: each owner decodes every rank's sparse
part, sums them in float32 and re-sparsifies the sum (error feedback on both sends).

Devices: buffers, codec work and error feedback stay on the tensors' device. Inside a site NCCL
moves CUDA tensors; when a WAN group is Gloo (``Groups.wan_staged``) only the WAN leg's wire
buffers pass through pinned host memory, copied on a side stream from the background WAN thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from cpn.runtime.bucketing import make_buckets
from cpn.runtime.codecs import Codec, ErrorFeedback, get_codec
from cpn.runtime.device import HostStage, ready_event
from cpn.runtime.groups import Groups, ProcessGroup, current_groups
from cpn.runtime.topology import TopologyError

__all__ = [
    "ALGORITHMS",
    "Stats",
    "allreduce",
    "broadcast_from_site_leader",
    "level_codecs",
    "parse_algorithm",
    "site_allreduce",
    "wan_allreduce",
]

ALGORITHMS = ("flat", "hierarchical", "leader", "multilevel")
Algorithm = Literal["flat", "hierarchical", "leader", "multilevel"]
DEFAULT_BUCKET_BYTES = 25 * 2**20
DEFAULT_CHUNK_BYTES = 4 * 2**20


@dataclass
class Stats:
    """Bytes this rank sent, split intra-site / WAN, by the algorithm's own count."""

    algorithm: str = ""
    compression: str | None = None
    numel: int = 0
    payload_bytes: int = 0
    intra_bytes: int = 0
    wan_bytes: int = 0
    buckets: int = 0
    metro_bytes: int = 0
    """Of ``wan_bytes``, those sent to sites of the same region (``multilevel`` only)."""
    seconds: float = 0.0

    def __add__(self, other: Stats) -> Stats:
        out = Stats(
            algorithm=self.algorithm or other.algorithm, compression=self.compression or other.compression
        )
        for f in fields(Stats):
            if f.name not in ("algorithm", "compression"):
                setattr(out, f.name, getattr(self, f.name) + getattr(other, f.name))
        return out


def parse_algorithm(spec: str) -> tuple[str, str | None]:
    """``"hierarchical+int8"`` -> ``("hierarchical", "int8")``; validates both halves."""
    algorithm, _, compression = spec.partition("+")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if algorithm == "multilevel":
        level_codecs(compression or None)
    else:
        get_codec(compression or None)
    return algorithm, compression or None


def level_codecs(compression: str | Codec | None) -> dict[str, Codec | None]:
    """Per-level codecs of ``multilevel``: ``"int8"`` (or a codec) -> the slowest cross-site level
    (key ``"top"``); ``"fp16/int8"`` -> metro fp16, long-haul int8; ``"none/int8"`` likewise."""
    if compression is None or isinstance(compression, Codec):
        return {"top": compression}
    if "/" not in compression:
        return {"top": get_codec(compression)}
    parts = compression.split("/")
    if len(parts) != 2:
        raise ValueError(
            f"multilevel compression {compression!r} names {len(parts)} levels; give metro/long-haul, e.g. none/int8"
        )
    return {"metro": get_codec(parts[0]), "wan": get_codec(parts[1])}


# ----------------------------------------------------------------------------- byte counts
def _ring_bytes(group_size: int, nbytes: int) -> int:
    """What one rank sends in a ring all-reduce: 2(P-1)/P of the buffer."""
    return 2 * (group_size - 1) * nbytes // group_size if group_size > 1 else 0


def _half_ring_bytes(group_size: int, nbytes: int) -> int:
    """What one rank sends in a ring reduce-scatter or all-gather: (P-1)/P of the buffer."""
    return (group_size - 1) * nbytes // group_size if group_size > 1 else 0


def _broadcast_bytes(g: Groups, nbytes: int) -> int:
    """Gloo broadcasts down a binomial tree; NCCL down a ring.  Counted for this rank."""
    w, r = g.site_size, (g.local_rank - g.topology.sites[g.site].leader) % g.site_size
    if g.backend != "gloo":
        return nbytes if r < w - 1 else 0
    children = sum(1 for k in range(w.bit_length()) if 2**k > r and r + 2**k < w)
    return children * nbytes


# ----------------------------------------------------------------------------- WAN leg
def _compressed_allreduce(
    x: Tensor, group: ProcessGroup, codec: Codec, ef: ErrorFeedback | None, key: Hashable,
    stage: HostStage | None = None, ready: Any = None,
) -> int:
    """Sum ``x`` over ``group`` moving only encoded bytes; returns the bytes this rank sent.

    With ``stage`` the wire buffers (not the float32 values) cross to pinned host memory."""
    p = dist.get_world_size(group)
    if p == 1:
        return 0
    n = x.numel()
    m = -(-n // p)
    m = -(-m // codec.align) * codec.align
    padded = torch.zeros(p * m, dtype=torch.float32, device=x.device)
    padded[:n].copy_(x)
    send = _encode_parts(padded, p, m, codec, ef, (key, "scatter"))
    send = stage.out(send, ready) if stage else send
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    recv = stage.to_device(recv) if stage else recv
    wb = codec.wire_bytes(m)
    mine = codec.decode(recv[:wb], m)
    for i in range(1, p):
        mine += codec.decode(recv[i * wb : (i + 1) * wb], m)
    wire = _encode_parts(mine, 1, m, codec, ef, (key, "gather"))
    wire = stage.out(wire) if stage else wire
    gathered = torch.empty(p * wb, dtype=torch.uint8, device=wire.device)
    dist.all_gather_into_tensor(gathered, wire, group=group)
    gathered = stage.to_device(gathered) if stage else gathered
    for i in range(p):
        part = x[i * m : min(n, (i + 1) * m)]
        if part.numel():
            part.copy_(codec.decode(gathered[i * wb : (i + 1) * wb], m)[: part.numel()])
    return 2 * (p - 1) * wb


def _encode_parts(
    x: Tensor, parts: int, m: int, codec: Codec, ef: ErrorFeedback | None, key: Hashable
) -> Tensor:
    if ef is not None:
        x = ef.compensate(key, x)
    wire = torch.cat([codec.encode(x[i * m : (i + 1) * m]) for i in range(parts)])
    if ef is not None:
        wb = codec.wire_bytes(m)
        sent = torch.cat([codec.decode(wire[i * wb : (i + 1) * wb], m) for i in range(parts)])
        ef.record(key, x, sent)
    return wire


def _wan_leg(
    buf: Tensor, group: ProcessGroup, codec: Codec | None, ef: ErrorFeedback | None, key: Hashable,
    stage: HostStage | None = None, ready: Any = None,
) -> int:
    """All-reduce ``buf`` over a WAN group; ``stage`` passes device tensors through pinned host
    memory (CUDA over Gloo), waiting for ``ready`` (the event after the buffer was produced)."""
    if codec is None or not buf.is_floating_point():
        host = stage.out(buf, ready) if stage else buf
        dist.all_reduce(host, group=group)
        if stage:
            stage.back(host, buf)
        return _ring_bytes(dist.get_world_size(group), buf.numel() * buf.element_size())
    work = buf if buf.dtype == torch.float32 else buf.float()
    sent = _compressed_allreduce(work, group, codec, ef, key, stage, ready)
    if work is not buf:
        buf.copy_(work)
    return sent


# ----------------------------------------------------------------------------- algorithms
def _flat(
    buf: Tensor, g: Groups, codec: Codec | None, ef: ErrorFeedback | None, key: Hashable
) -> tuple[int, int]:
    """Gloo's ring all-reduce sends to rank r-1 and its all-gather to r+1 (measured with ``ss``),
    so with ranks numbered site by site a site's first rank (all-reduce) or last rank (all-gather)
    is the one whose ring hop crosses the WAN."""
    n = g.world_size
    sent = _wan_leg(buf, g.world, codec, ef, key, _stage(g))
    if codec is None or not buf.is_floating_point():
        return (0, sent) if g.S > 1 and g.local_rank == 0 else (sent, 0)
    wb = sent // (2 * (n - 1)) if n > 1 else 0
    a2a_wan, a2a_intra = (n - g.site_size) * wb, (g.site_size - 1) * wb
    gather = (n - 1) * wb
    if g.S > 1 and g.local_rank == g.site_size - 1:
        return a2a_intra, a2a_wan + gather
    return a2a_intra + gather, a2a_wan


def _stage(g: Groups) -> HostStage | None:
    return g.stage if g.wan_staged else None


@dataclass
class _Job:
    """One bucket between the phases of a two-level algorithm: intra (pre) -> WAN -> intra (post)."""

    buf: Tensor
    padded: Tensor
    shard: Tensor
    key: Hashable
    intra: int = 0
    wan: int = 0
    ready: Any = None  # CUDA event after the intra-site phase, for the WAN thread's staging copy


def _pad(buf: Tensor, parts: int) -> Tensor:
    n = buf.numel()
    extra = -n % parts
    return torch.cat([buf, buf.new_zeros(extra)]) if extra else buf


def _reduce_scatter(padded: Tensor, g: Groups) -> tuple[Tensor, int]:
    """Intra-site reduce-scatter; returns this rank's reduced 1/W shard and the bytes sent.

    Gloo's ``reduce_scatter_tensor`` is a full all-reduce underneath (2(W-1)/W of the buffer sent,
    measured), so on Gloo it is an ``all_to_all`` plus a local sum: (W-1)/W, the textbook amount.
    """
    w = g.site_size
    nbytes = padded.numel() * padded.element_size()
    if w == 1:
        return padded, 0
    if g.backend != "gloo":
        shard = padded.new_empty(padded.numel() // w)
        dist.reduce_scatter_tensor(shard, padded, group=g.intra)
        return shard, _half_ring_bytes(w, nbytes)
    recv = torch.empty_like(padded)
    dist.all_to_all_single(recv, padded, group=g.intra)
    return recv.view(w, -1).sum(dim=0), _half_ring_bytes(w, nbytes)


class _Hierarchical:
    """2D torus: reduce-scatter in the site, W parallel cross-site all-reduces, all-gather in the site."""

    @staticmethod
    def pre(buf: Tensor, g: Groups, key: Hashable) -> _Job:
        padded = _pad(buf, g.site_size)
        shard, sent = _reduce_scatter(padded, g)
        return _Job(buf, padded, shard, key, intra=sent, ready=ready_event(shard.device) if g.wan_staged else None)

    @staticmethod
    def wan(job: _Job, g: Groups, codec: Codec | None, ef: ErrorFeedback | None) -> None:
        if g.S > 1:
            job.wan += _wan_leg(job.shard, g.cross, codec, ef, job.key, _stage(g), job.ready)

    @staticmethod
    def post(job: _Job, g: Groups) -> None:
        w = g.site_size
        if w > 1:
            dist.all_gather_into_tensor(job.padded, job.shard, group=g.intra)
            job.intra += _half_ring_bytes(w, job.padded.numel() * job.padded.element_size())
        if job.padded is not job.buf:
            job.buf.copy_(job.padded[: job.buf.numel()])


class _Leader:
    """Reduce to the site leader (reduce-scatter + gather), leaders all-reduce, broadcast in the site."""

    @staticmethod
    def pre(buf: Tensor, g: Groups, key: Hashable) -> _Job:
        w = g.site_size
        if w == 1:
            return _Job(buf, buf, buf, key, ready=ready_event(buf.device) if g.wan_staged else None)
        padded = _pad(buf, w)
        shard, sent = _reduce_scatter(padded, g)
        parts = list(padded.chunk(w)) if g.is_leader else None
        dist.gather(shard, parts, dst=g.leader_rank, group=g.intra)
        sent += 0 if g.is_leader else shard.numel() * shard.element_size()
        return _Job(buf, padded, padded, key, intra=sent, ready=ready_event(buf.device) if g.wan_staged else None)

    @staticmethod
    def wan(job: _Job, g: Groups, codec: Codec | None, ef: ErrorFeedback | None) -> None:
        if g.S > 1 and g.is_leader:
            job.wan += _wan_leg(job.padded, g.leaders, codec, ef, job.key, _stage(g), job.ready)

    @staticmethod
    def post(job: _Job, g: Groups) -> None:
        if g.site_size > 1:
            dist.broadcast(job.padded, src=g.leader_rank, group=g.intra)
            job.intra += _broadcast_bytes(g, job.padded.numel() * job.padded.element_size())
        if job.padded is not job.buf:
            job.buf.copy_(job.padded[: job.buf.numel()])


_TWO_LEVEL = {"hierarchical": _Hierarchical, "leader": _Leader}


def _slices(buf: Tensor, chunk_numel: int) -> list[Tensor]:
    return list(buf.split(chunk_numel)) if buf.numel() > chunk_numel else [buf]


def _run_two_level(
    algo: type[_Hierarchical] | type[_Leader],
    bufs: list[Tensor],
    g: Groups,
    codec: Codec | None,
    ef: ErrorFeedback | None,
    key: Hashable,
    chunk_bytes: int,
) -> list[tuple[int, int]]:
    """Pipeline ``chunk_bytes`` slices of the buckets: while slice i is on the WAN (one background
    thread, so the WAN groups see the same order on every rank), the main thread reduces slice i+1
    inside the site.  Smaller slices fill and drain the pipeline faster but pay the WAN latency
    once each.  Returns (intra, wan) bytes per bucket."""
    work = [
        (b, (key, b, c), part)
        for b, buf in enumerate(bufs)
        for c, part in enumerate(_slices(buf, max(1, chunk_bytes // buf.element_size())))
    ]
    counts = [[0, 0] for _ in bufs]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpn-wan") as pool:
        staged = []
        for b, k, part in work:
            job = algo.pre(part, g, k)
            staged.append((b, job, pool.submit(algo.wan, job, g, codec, ef)))
        for b, job, fut in staged:
            fut.result()
            algo.post(job, g)
            counts[b][0] += job.intra
            counts[b][1] += job.wan
    return [(intra, wan) for intra, wan in counts]


# ----------------------------------------------------------------------------- multilevel
@dataclass
class _LevelJob:
    """One slice through the levels: ``shards[i]`` is this rank's part below cross-site level i."""

    buf: Tensor
    padded: Tensor
    key: Hashable
    shards: list[Tensor]
    device_shard: Tensor | None = None  # the site-level shard on the device when the WAN is staged
    ready: Any = None
    intra: int = 0
    metro: int = 0
    wan: int = 0

    def count(self, level: str, sent: int) -> None:
        if level == "site":
            self.intra += sent
        elif level == "metro":
            self.metro += sent
        else:
            self.wan += sent


def _level_rs(
    x: Tensor, group: ProcessGroup, n: int, codec: Codec | None, ef: ErrorFeedback | None,
    key: Hashable, nccl: bool = False,
) -> tuple[Tensor, int]:
    """Reduce-scatter ``x`` (length a multiple of n, and of n*align when compressed) over ``group``:
    this rank's summed 1/n part and the bytes it sent ((n-1)/n of the wire buffer)."""
    m = x.numel() // n
    if codec is None or not x.is_floating_point():
        if nccl:
            out = x.new_empty(m)
            dist.reduce_scatter_tensor(out, x, group=group)
            return out, _half_ring_bytes(n, x.numel() * x.element_size())
        recv = torch.empty_like(x)
        dist.all_to_all_single(recv, x, group=group)
        return recv.view(n, -1).sum(dim=0), _half_ring_bytes(n, x.numel() * x.element_size())
    work = x if x.dtype == torch.float32 else x.float()
    send = _encode_parts(work, n, m, codec, ef, (key, "rs"))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    wb = codec.wire_bytes(m)
    mine = codec.decode(recv[:wb], m)
    for i in range(1, n):
        mine += codec.decode(recv[i * wb : (i + 1) * wb], m)
    return mine.to(x.dtype), (n - 1) * wb


def _level_ag(
    shard: Tensor, out: Tensor, group: ProcessGroup, n: int, codec: Codec | None,
    ef: ErrorFeedback | None, key: Hashable,
) -> int:
    """All-gather every rank's ``shard`` into ``out`` (n shards); returns the bytes this rank sent."""
    if codec is None or not shard.is_floating_point():
        dist.all_gather_into_tensor(out, shard, group=group)
        return _half_ring_bytes(n, out.numel() * out.element_size())
    m = shard.numel()
    wire = _encode_parts(shard.float(), 1, m, codec, ef, (key, "ag"))
    wb = wire.numel()
    gathered = torch.empty(n * wb, dtype=torch.uint8, device=wire.device)
    dist.all_gather_into_tensor(gathered, wire, group=group)
    for i in range(n):
        out[i * m : (i + 1) * m].copy_(codec.decode(gathered[i * wb : (i + 1) * wb], m))
    return (n - 1) * wb


class _Multilevel:
    """Reduce-scatter up the levels, all-reduce the top one, all-gather down.

    The site level runs on the caller's thread; every cross-site level has its own one-thread
    executor, fed in a fixed order (every slice's reduce-scatter, then every slice's all-gather), so
    each group sees the same sequence of collectives on every rank while the levels overlap: the
    metro reduce-scatter of slice i+1 runs while slice i is on the long-haul links.
    """

    def __init__(self, g: Groups, codecs: dict[str, Codec | None], ef: ErrorFeedback | None) -> None:
        self.g = g
        self.ef = ef
        levels = g.levels()
        self.site = levels[0] if levels and levels[0][0] == "site" else None
        self.upper = levels[1:] if self.site else levels
        top = self.upper[-1][0] if self.upper else None
        self.codecs = {name: codecs.get(name) for name, _, _ in self.upper}
        if top is not None and "top" in codecs:
            self.codecs[top] = codecs["top"]
        rs_levels = levels[:-1]
        aligns = [self.codecs[n].align for n, _, _ in rs_levels if self.codecs.get(n) is not None]
        self.unit = math.prod(size for _, _, size in rs_levels) * math.lcm(1, *aligns)
        self.staged = _stage(g)

    # -- caller's thread
    def pre(self, buf: Tensor, key: Hashable) -> _LevelJob:
        padded = _pad(buf, self.unit)
        job = _LevelJob(buf, padded, key, [padded])
        if self.site is None:
            return job
        _, grp, n = self.site
        nccl = self.g.backend != "gloo"
        if not self.upper:
            dist.all_reduce(padded, group=grp)
            job.intra += _ring_bytes(n, padded.numel() * padded.element_size())
            return job
        shard, sent = _level_rs(padded, grp, n, None, None, key, nccl)
        job.shards = [shard]
        job.intra += sent
        job.ready = ready_event(shard.device) if self.staged else None
        return job

    def post(self, job: _LevelJob) -> None:
        if self.site is not None and self.upper:
            _, grp, n = self.site
            shard = job.device_shard if job.device_shard is not None else job.shards[0]
            job.intra += _level_ag(shard, job.padded, grp, n, None, None, job.key)
        if job.padded is not job.buf:
            job.buf.copy_(job.padded[: job.buf.numel()])

    # -- executor threads
    def up(self, job: _LevelJob, i: int, before: Any) -> None:
        if before is not None:
            before.result()
        if i == 0 and self.staged:
            job.device_shard = job.shards[0]
            job.shards[0] = self.staged.out(job.shards[0], job.ready)
        name, grp, n = self.upper[i]
        codec = self.codecs[name]
        if i == len(self.upper) - 1:
            job.count(name, _wan_leg(job.shards[i], grp, codec, self.ef, (job.key, name)))
            if i == 0:
                self._unstage(job)
            return
        shard, sent = _level_rs(job.shards[i], grp, n, codec, self.ef, (job.key, name))
        job.shards.append(shard)
        job.count(name, sent)

    def down(self, job: _LevelJob, i: int, before: Any) -> None:
        before.result()
        name, grp, n = self.upper[i]
        job.count(name, _level_ag(job.shards[i + 1], job.shards[i], grp, n, self.codecs[name], self.ef, (job.key, name)))
        if i == 0:
            self._unstage(job)

    def _unstage(self, job: _LevelJob) -> None:
        if self.staged and job.device_shard is not None:
            self.staged.back(job.shards[0], job.device_shard)


def _run_multilevel(
    bufs: list[Tensor],
    g: Groups,
    codecs: dict[str, Codec | None],
    ef: ErrorFeedback | None,
    key: Hashable,
    chunk_bytes: int,
) -> list[tuple[int, int, int]]:
    """Pipeline ``chunk_bytes`` slices through the levels; (intra, metro, long-haul) bytes per bucket."""
    algo = _Multilevel(g, codecs, ef)
    work = [
        (b, (key, b, c), part)
        for b, buf in enumerate(bufs)
        for c, part in enumerate(_slices(buf, max(1, chunk_bytes // buf.element_size())))
    ]
    counts = [[0, 0, 0] for _ in bufs]
    levels = len(algo.upper)
    pools = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"cpn-level{i}") for i in range(levels)]
    try:
        staged = []
        for b, k, part in work:
            job = algo.pre(part, k)
            fut = None
            for i in range(levels):
                fut = pools[i].submit(algo.up, job, i, fut)
            staged.append((b, job, fut))
        finals = []
        for b, job, fut in staged:
            for i in range(levels - 2, -1, -1):
                fut = pools[i].submit(algo.down, job, i, fut)
            finals.append((b, job, fut))
        for b, job, fut in finals:
            if fut is not None:
                fut.result()
            algo.post(job)
            counts[b][0] += job.intra
            counts[b][1] += job.metro
            counts[b][2] += job.wan
    finally:
        for pool in pools:
            pool.shutdown(wait=True)
    return [(intra, metro, wan) for intra, metro, wan in counts]


def _resolve(algorithm: str, g: Groups) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if algorithm == "hierarchical" and g.W is None:
        raise TopologyError(
            f"hierarchical all-reduce needs the same number of workers at every site, got "
            f"{[s.ranks for s in g.topology.sites]}; use algorithm='leader' or even out the sites"
        )
    if algorithm == "multilevel":
        g.topology.level_sizes()  # raises with the fix when sites or regions are unequal
    return algorithm


def _as_list(tensors: Tensor | Sequence[Tensor]) -> list[Tensor]:
    return [tensors] if isinstance(tensors, Tensor) else list(tensors)


def _finish(tensors: list[Tensor], op: str, world: int) -> None:
    if op == "sum":
        return
    for t in tensors:
        if not t.is_floating_point():
            raise TypeError(
                f"op='avg' needs floating tensors, got {t.dtype}; use op='sum' and divide yourself"
            )
        t.div_(world)


def _check_op(op: str) -> None:
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")


def allreduce(
    tensors: Tensor | Sequence[Tensor],
    algorithm: Algorithm | str = "flat",
    groups: Groups | None = None,
    compression: str | Codec | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    op: Literal["sum", "avg"] = "sum",
    error_feedback: ErrorFeedback | None = None,
    key: Hashable = "allreduce",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Stats:
    """Sum (or average) ``tensors`` in place across every rank; every rank passes the same shapes.

    ``algorithm`` may carry its compression as ``"hierarchical+int8"``.  ``key`` names the call for
    error feedback: use one key per distinct tensor list (e.g. ``"grads"``).  Two-level algorithms
    pipeline ``chunk_bytes`` slices of each bucket (intra-site work overlaps the WAN transfer).
    """
    if "+" in algorithm:
        algorithm, compression = parse_algorithm(algorithm)
    _check_op(op)
    g = groups or current_groups()
    algorithm = _resolve(algorithm, g)
    if algorithm == "multilevel":
        codecs = level_codecs(compression)
        codec = None
        names = {k: c.name if c else "none" for k, c in codecs.items()}
        label = names.get("top") or f"{names['metro']}/{names['wan']}"
        label = None if label == "none" else label
    else:
        codec = get_codec(compression)
        label = codec.name if codec else None
    tensors = _as_list(tensors)
    stats = Stats(algorithm=algorithm, compression=label)
    t0 = time.perf_counter()
    buckets = make_buckets(tensors, bucket_bytes)
    if algorithm == "multilevel":
        bufs = [b.flat for b in buckets]
        levels = _run_multilevel(bufs, g, codecs, error_feedback, key, chunk_bytes)
        counts = [(intra, metro + wan) for intra, metro, wan in levels]
        stats.metro_bytes = sum(metro for _, metro, _ in levels)
    elif algorithm == "flat":
        counts = [_flat(b.flat, g, codec, error_feedback, (key, i)) for i, b in enumerate(buckets)]
    else:
        bufs = [b.flat for b in buckets]
        counts = _run_two_level(_TWO_LEVEL[algorithm], bufs, g, codec, error_feedback, key, chunk_bytes)
    for bucket, (intra, wan) in zip(buckets, counts, strict=True):
        bucket.unpack()
        stats.intra_bytes += intra
        stats.wan_bytes += wan
        stats.numel += bucket.flat.numel()
        stats.payload_bytes += bucket.nbytes
        stats.buckets += 1
    _finish(tensors, op, g.world_size)
    stats.seconds = time.perf_counter() - t0
    return stats


# ----------------------------------------------------------------------------- helpers for strategies
def site_allreduce(
    tensors: Tensor | Sequence[Tensor],
    groups: Groups | None = None,
    op: Literal["sum", "avg"] = "sum",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Stats:
    """All-reduce within this rank's site only (local SGD's inner sync, DiLoCo's per-site average)."""
    _check_op(op)
    g = groups or current_groups()
    tensors = _as_list(tensors)
    stats = Stats(algorithm="site")
    t0 = time.perf_counter()
    for bucket in make_buckets(tensors, bucket_bytes):
        if g.site_size > 1:
            dist.all_reduce(bucket.flat, group=g.intra)
        bucket.unpack()
        stats.intra_bytes += _ring_bytes(g.site_size, bucket.nbytes)
        stats.payload_bytes += bucket.nbytes
        stats.numel += bucket.flat.numel()
        stats.buckets += 1
    _finish(tensors, op, g.site_size)
    stats.seconds = time.perf_counter() - t0
    return stats


def wan_allreduce(
    tensors: Tensor | Sequence[Tensor],
    groups: Groups | None = None,
    via: Literal["leaders", "cross"] = "leaders",
    compression: str | Codec | None = None,
    op: Literal["sum", "avg"] = "sum",
    error_feedback: ErrorFeedback | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    key: Hashable = "wan",
    group: ProcessGroup | None = None,
) -> Stats:
    """All-reduce across sites only, among the leaders or this rank's same-local-rank group, or
    ``group``: a cross-site group of the caller's own (e.g. a pipeline stage's replicas; ``via`` is
    then only the stats' name).

    Ranks outside the chosen group return at once with zero stats (with ``via="leaders"`` only
    leaders take part; follow with :func:`broadcast_from_site_leader`).  ``avg`` divides by the
    number of sites taking part.
    """
    _check_op(op)
    g = groups or current_groups()
    if group is None:
        group = g.leaders if via == "leaders" else g.cross
    codec = get_codec(compression)
    stats = Stats(algorithm=f"wan-{via}", compression=codec.name if codec else None)
    if group is None:
        return stats
    tensors = _as_list(tensors)
    t0 = time.perf_counter()
    for i, bucket in enumerate(make_buckets(tensors, bucket_bytes)):
        stats.wan_bytes += _wan_leg(bucket.flat, group, codec, error_feedback, (key, i), _stage(g))
        bucket.unpack()
        stats.payload_bytes += bucket.nbytes
        stats.numel += bucket.flat.numel()
        stats.buckets += 1
    _finish(tensors, op, dist.get_world_size(group))
    stats.seconds = time.perf_counter() - t0
    return stats


def broadcast_from_site_leader(
    tensors: Tensor | Sequence[Tensor],
    groups: Groups | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Stats:
    """Copy the site leader's tensors to the other ranks of its site (after a leaders-only step)."""
    g = groups or current_groups()
    tensors = _as_list(tensors)
    stats = Stats(algorithm="site-broadcast")
    t0 = time.perf_counter()
    for bucket in make_buckets(tensors, bucket_bytes):
        if g.site_size > 1:
            dist.broadcast(bucket.flat, src=g.leader_rank, group=g.intra)
        bucket.unpack()
        stats.intra_bytes += _broadcast_bytes(g, bucket.nbytes) if g.site_size > 1 else 0
        stats.payload_bytes += bucket.nbytes
        stats.numel += bucket.flat.numel()
        stats.buckets += 1
    stats.seconds = time.perf_counter() - t0
    return stats
