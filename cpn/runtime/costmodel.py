"""The alpha-beta cost model of the all-reduce algorithms, for predictions next to measurements.

A message of n bytes over a link costs ``alpha + n * beta``.  Per all-reduce of K bytes over S
sites of W workers (N = S*W), with each site's WAN uplink the bottleneck:

- flat ring over N ranks:  2(N-1) * alpha_wan + 2(N-1)/N * K * beta_wan   (every step waits on a WAN hop,
  and each site's uplink carries one ring crossing);
- hierarchical:            2(W-1)/W * k * beta_intra + C * 2(S-1) * alpha_wan + 2(S-1)/S * K * c * beta_wan;
- leader:                  2(W-1) * k * beta_intra + C * 2(S-1) * alpha_wan + 2(S-1)/S * K * c * beta_wan;

where the two-level algorithms pipeline C = K/k chunks of k bytes (the intra-site work of all but one
chunk hides behind the WAN transfer, and every chunk pays the WAN latency), plus, when compressed
(wire ratio c), the codec's CPU time, shared by the ranks running at once.
The WAN lower bound for an uncompressed all-reduce is 2(S-1)/S * K / B.  Large messages are
beta-bound, so flat loses to the others by (N-1)/N : (S-1)/S; small ones are alpha-bound, so the
algorithm with the fewest WAN-latency steps wins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "CPU_SLOT_MFU",
    "CPU_SLOT_TFLOPS",
    "WIRE_BYTES_PER_VALUE",
    "CostParams",
    "lower_bound_seconds",
    "predict_multilevel_seconds",
    "predict_seconds",
    "wire_ratio",
]

# One CPU slot (a core running fp32 PyTorch): its matmul peak (a 256² or 512² torch matmul, 1 thread: 0.099
# TFLOP per CPU-second on this machine, timed by thread CPU time so other load does not count) and the share
# of it a training step gets (0.040 TFLOP/s of 6·parameters·tokens per CPU-second, measured 2026-11-25:
# docs/benchmarks/calibration.md). The planner prices "CPU" slots with them, the runtime's defaults order
# strategies with them: one source.
BALANCE_THRESHOLD = 1.25  # speeds closer than this are taken as equal (the measurement's noise on shared CPUs);
# the runtime's balanced shares and the planner's pricing of them read it here
CPU_SLOT_TFLOPS = 0.10
CPU_SLOT_MFU = 0.40

_ETH_OVERHEAD = 1514 / 1448  # bytes on the wire per TCP payload byte, MTU 1500 with timestamps
_INT8_CHUNK = 256
# Wire bytes per float32 value of each WAN codec (cpn.runtime.codecs), the one table the runtime's
# cost model, the autotuner and the planner read: int8 one fp32 scale per 256 values, int4 two values
# a byte and one fp16 scale per 64, topk at its default 1 % density fp16 values + uint16 offsets + one
# uint32 count per 65536 values (a topk:<density> codec scales the first two terms).
WIRE_BYTES_PER_VALUE: dict[str, float] = {
    "none": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1 + 4 / _INT8_CHUNK, "int4": 0.5 + 2 / 64,
    "topk": 0.01 * (2 + 2) + 4 / 65536,
}


# int4 and topk scaled from int8's by their ratio to it measured on the same (loaded) machine
_ENCODE_GBYTES_S = {"int8": 0.7, "int4": 0.75, "topk": 0.2, "fp16": 3.5, "bf16": 5.0}
_DECODE_GBYTES_S = {"int8": 1.0, "int4": 0.65, "topk": 1.8, "fp16": 2.3, "bf16": 2.0}


@dataclass(frozen=True, kw_only=True)
class CostParams:
    """Machine constants; the defaults were measured on the 2-core development machines."""

    rtt_ms: float = 0.0
    intra_gbps: float = 8.0
    intra_alpha_us: float = 100.0
    encode_gbytes_s: dict[str, float] | None = None
    decode_gbytes_s: dict[str, float] | None = None
    cores: int = os.cpu_count() or 1

    def encode_rate(self, codec: str) -> float:
        """float32 bytes encoded per second by one core."""
        return (self.encode_gbytes_s or _ENCODE_GBYTES_S)[codec] * 1e9

    def decode_rate(self, codec: str) -> float:
        return (self.decode_gbytes_s or _DECODE_GBYTES_S)[codec] * 1e9


def wire_ratio(compression: str | None) -> float:
    """Wire bytes per float32 byte on the WAN leg."""
    if compression is None:
        return 1.0
    return WIRE_BYTES_PER_VALUE[compression] / 4


def lower_bound_seconds(size_bytes: float, sites: int, wan_mbps: float) -> float:
    """2(S-1)/S * K / B: what every site must push through its uplink in an uncompressed all-reduce."""
    return 2 * (sites - 1) / sites * size_bytes * 8 / (wan_mbps * 1e6)


def _codec_seconds(
    per_rank_bytes: float, sites: int, busy_ranks: int, codec: str | None, p: CostParams
) -> float:
    """Encode own parts, decode S parts, encode the sum, decode the gathered result."""
    if codec is None:
        return 0.0
    work = (1 + 1 / sites) * per_rank_bytes / p.encode_rate(codec) + 2 * per_rank_bytes / p.decode_rate(codec)
    return work * max(1.0, busy_ranks / p.cores)


def predict_seconds(
    algorithm: str,
    size_bytes: float,
    sites: int,
    workers_per_site: int,
    wan_mbps: float,
    compression: str | None = None,
    params: CostParams | None = None,
    chunk_bytes: float = 4 * 2**20,
) -> float:
    """Predicted seconds for one all-reduce of ``size_bytes`` float32 bytes."""
    p = params or CostParams()
    s, w = sites, workers_per_site
    n = s * w
    k = float(size_bytes)
    a_wan = p.rtt_ms / 2e3 if s > 1 else 0.0
    b_wan = 8 * _ETH_OVERHEAD / (wan_mbps * 1e6)
    b_intra = 8 / (p.intra_gbps * 1e9)
    a_intra = p.intra_alpha_us / 1e6
    c = wire_ratio(compression)
    if algorithm == "flat":
        if s == 1:
            return 2 * (n - 1) * a_intra + 2 * (n - 1) / n * k * b_intra
        return (
            2 * (n - 1) * a_wan
            + 2 * (n - 1) / n * k * c * b_wan
            + _codec_seconds(k / n, n, n, compression, p)
        )
    chunks = max(1, -(-int(k) // int(chunk_bytes)))
    exposed = k if s == 1 else min(k, chunk_bytes)  # intra-site bytes not hidden behind the WAN
    wan = chunks * 2 * (s - 1) * a_wan + 2 * (s - 1) / s * k * c * b_wan if s > 1 else 0.0
    if algorithm == "hierarchical":
        intra = 2 * (w - 1) * a_intra + 2 * (w - 1) / w * exposed * b_intra
        return intra + wan + (_codec_seconds(k / w, s, n, compression, p) if s > 1 else 0.0)
    if algorithm == "leader":
        intra = 2 * (w - 1) * (a_intra + exposed * b_intra)
        return intra + wan + (_codec_seconds(k, s, s, compression, p) if s > 1 else 0.0)
    if algorithm == "multilevel":  # every site its own region: the levels of hierarchical
        return predict_multilevel_seconds(
            k, w, 1, s, None, wan_mbps, None, compression, p, chunk_bytes
        )
    raise ValueError(f"unknown algorithm {algorithm!r}; choose flat, hierarchical, leader or multilevel")


def predict_multilevel_seconds(
    size_bytes: float,
    workers_per_site: int,
    sites_per_region: int,
    regions: int,
    metro_mbps: float | None,
    wan_mbps: float,
    metro_compression: str | None = None,
    wan_compression: str | None = None,
    params: CostParams | None = None,
    chunk_bytes: float = 4 * 2**20,
) -> float:
    """Predicted seconds of the ``multilevel`` all-reduce of K bytes over G regions of R sites of W
    workers, every pair of sites on its own link (metro inside a region, long-haul between).

    Per site, the metro reduce-scatter (an all-to-all) sends K/R to each other site of the region
    and the all-gather (a ring) (R-1)/R * K to its neighbour; the long-haul ring over G regions
    sends 2(G-1)/G * K/R over each of its links, with the W workers' shards sharing a link.  The
    levels run in their own threads over C = K/k slices, so the slowest level's total sets the pace
    and the others add one slice each (fill and drain).  ``metro_mbps=None`` is an unshaped metro.
    """
    p = params or CostParams()
    w, r, g = workers_per_site, sites_per_region, regions
    k = float(size_bytes)
    chunk = min(k, float(chunk_bytes))
    chunks = max(1, -(-int(k) // int(chunk_bytes)))
    b_intra = 8 / (p.intra_gbps * 1e9)
    a_intra = p.intra_alpha_us / 1e6
    a_wan = p.rtt_ms / 2e3
    b_metro = 8 * _ETH_OVERHEAD / (metro_mbps * 1e6) if metro_mbps else b_intra
    b_wan = 8 * _ETH_OVERHEAD / (wan_mbps * 1e6)
    c_metro, c_wan = wire_ratio(metro_compression), wire_ratio(wan_compression)

    def site(x: float) -> float:  # reduce-scatter or all-gather of x bytes inside the site
        return (w - 1) * a_intra + (w - 1) / w * x * b_intra if w > 1 else 0.0

    def metro(x: float, steps: int) -> tuple[float, float]:  # (reduce-scatter, all-gather) per site
        if r == 1:
            return 0.0, 0.0
        return (
            steps * a_wan + x / r * c_metro * b_metro,
            steps * (r - 1) * a_wan + (r - 1) / r * x * c_metro * b_metro,
        )

    if r == 1 and g == 1:
        return 2 * site(k)
    n = w * r * g
    codec = 0.0
    if metro_compression and r > 1:
        codec += _codec_seconds(k / w, r, n, metro_compression, p)
    if wan_compression and g > 1:
        codec += _codec_seconds(k / (w * r), g, n, wan_compression, p)
    if g == 1:  # the metro level is the top: a ring all-reduce of the site's K/W shards
        top = chunks * 2 * (r - 1) * a_wan + 2 * (r - 1) / r * k * c_metro * b_metro
        return top + 2 * site(chunk) + codec
    rs, ag = metro(k, chunks)
    top = chunks * 2 * (g - 1) * a_wan + 2 * (g - 1) / g * (k / r) * c_wan * b_wan
    rs_c, ag_c = metro(chunk, 1)
    return max(rs + ag, top) + site(chunk) + rs_c + ag_c + site(chunk) + codec
