"""Byte accounting: the algorithms' own counts against the kernel's, on a known payload."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpn.runtime.accounting import ByteCount, Meter, classify, cross_check, parse_ss
from cpn.runtime.collectives import allreduce, broadcast_from_site_leader, site_allreduce, wan_allreduce
from cpn.runtime.costmodel import _ETH_OVERHEAD  # 66 header bytes per 1448-byte segment
from cpn.runtime.groups import init_groups, shutdown

PAYLOAD = 2**20  # bytes; 2**18 float32, divisible by every S, W used here
CALLS = {
    "flat": lambda x: allreduce(x, algorithm="flat"),
    "hierarchical": lambda x: allreduce(x, algorithm="hierarchical"),
    "leader": lambda x: allreduce(x, algorithm="leader"),
    "hierarchical+int8": lambda x: allreduce(x, algorithm="hierarchical+int8"),
    "leader+fp16": lambda x: allreduce(x, algorithm="leader+fp16"),
    "flat+int8": lambda x: allreduce(x, algorithm="flat+int8"),
    "site_allreduce": site_allreduce,
    "wan_allreduce(cross)": lambda x: wan_allreduce(x, via="cross"),
    "broadcast_from_site_leader": broadcast_from_site_leader,
}


def accounting_worker() -> list[str]:
    """Every rank: counted vs measured bytes for each call, plus the site veth's count on leaders."""
    g = init_groups()
    x = torch.randn(PAYLOAD // 4)
    problems = []
    for name, call in CALLS.items():
        meter = Meter()
        meter.start()
        dist.barrier()
        stats = call(x)
        dist.barrier()
        measured, iface = meter.stop()
        counted = ByteCount(stats.intra_bytes, stats.wan_bytes)
        if meter.site_addr is None:  # no emulation: the kernel cannot tell WAN from intra
            counted, measured = (
                ByteCount(counted.intra + counted.wan),
                ByteCount(measured.intra + measured.wan),
            )
        problems += [
            f"rank {g.rank} {name}: {p}" for p in cross_check(counted, measured, rel=0.02, slack=8192)
        ]
        sums = [(0, 0, 0)] * g.world_size
        mine = (measured.wan, meter.retransmitted.wan, iface if g.local_rank == 0 else 0)
        dist.all_gather_object(sums, mine)
        wan, again, seen = (sum(s[i] or 0 for s in sums) for i in range(3))
        if iface is not None and g.rank == 0:
            problems += _veth_problems(name, seen, wan, again)
    shutdown()
    return problems


# Frames on a veth, per payload byte, at most: 66 header bytes per 1448-byte segment when each segment is
# its own frame (tbf splits a GSO packet larger than its burst), plus one 66-byte ACK per two segments
# the site receives.  With GSO intact it is about 1.005 (measured here); CI once saw 1.050.
WIRE_PER_PAYLOAD = 1 + 1.5 * (_ETH_OVERHEAD - 1)


def _veth_problems(name: str, seen: int, payload: int, again: int) -> list[str]:
    """The veths carry the payload once, plus what TCP sent again after a drop at the shaper's queue,
    in frames with headers; the store's control traffic is inside the 16 KiB slack."""
    low, high = 0.97 * payload - 16384, WIRE_PER_PAYLOAD * (payload + again) + 16384
    if low <= seen <= high:
        return []
    return [f"{name}: veths saw {seen} WAN bytes, sockets {payload} (+{again} sent again)"]


def _failures(results: list[list[str]]) -> list[str]:
    return sorted({p for per_rank in results for p in per_rank})


@pytest.mark.serial  # its forked workers hung once under xdist's threaded worker (CI, 2026-11-28): run alone
def test_counts_match_sockets_without_emulation(run_workers) -> None:
    assert not _failures(run_workers(2, 2, accounting_worker))
    assert not _failures(run_workers(1, 3, accounting_worker))


def test_counts_match_sockets_and_veths_behind_emulated_wan(root, run_workers) -> None:
    assert not _failures(run_workers(2, 2, accounting_worker, wan_mbps=2000))


def test_veth_bytes_may_exceed_the_payload_by_what_tcp_sent_again() -> None:
    assert _veth_problems("x", seen=4_409_032, payload=4_198_336, again=0) == []  # CI's figures: headers
    assert _veth_problems("x", seen=4_650_000, payload=4_198_336, again=180_000) == []
    assert _veth_problems("x", seen=4_800_000, payload=4_198_336, again=0) == [
        "x: veths saw 4800000 WAN bytes, sockets 4198336 (+0 sent again)"
    ]
    assert _veth_problems("x", seen=3_000_000, payload=4_198_336, again=180_000)  # too few is still wrong


def test_parse_ss_and_classify() -> None:
    text = (
        'ESTAB 0 0 10.231.0.1:41000 10.231.0.2:5000 users:(("python",pid=42,fd=7))\n'
        "\t cubic bytes_sent:900 bytes_retrans:100 bytes_acked:700 bytes_received:5\n"
        'ESTAB 0 0 10.231.0.1:41001 10.231.0.1:5001 users:(("python",pid=42,fd=8))\n'
        "\t cubic bytes_sent:300 bytes_acked:300\n"
        'ESTAB 0 0 [::ffff:127.0.0.1]:41002 [::ffff:127.0.0.1]:5002 users:(("python",pid=42,fd=9))\n'
        "\t cubic bytes_sent:20\n"
        'ESTAB 0 0 10.231.0.1:41003 10.231.0.3:5003 users:(("other",pid=7,fd=9))\n'
        "\t cubic bytes_acked:99999\n"
    )
    counts = parse_ss(text, pid=42)
    assert len(counts) == 3
    assert classify(counts, "10.231.0.1") == ByteCount(intra=320, wan=800)
    assert classify(counts, None) == ByteCount(intra=1120, wan=0)
    again = parse_ss(text, pid=42, retransmitted=True)
    assert classify(again, "10.231.0.1") == ByteCount(intra=0, wan=100)


def test_cross_check_reports_disagreement() -> None:
    assert cross_check(ByteCount(1000, 10**6), ByteCount(1010, 10**6 + 100), slack=0, rel=0.02) == []
    assert cross_check(ByteCount(0, 10**6), ByteCount(0, 2 * 10**6), slack=0) == [
        "wan: algorithm counted 1000000 bytes, kernel measured 2000000"
    ]
