"""Measured byte accounting: what the kernel saw a rank send, intra-site vs across the WAN.

Two independent kernel sources cross-check the algorithms' own counts (:class:`~cpn.runtime.collectives.Stats`):

- per rank: the TCP sockets the process owns (``ss -tinpH``: ``bytes_sent`` less ``bytes_retrans``,
  since ``bytes_acked`` lags behind delayed ACKs), classified by
  peer address — a peer at this site's address (or loopback) is intra-site, anything else is WAN;
- per site: the WAN veth's interface counters (``/sys/class/net/<veth>/statistics/tx_bytes``, read
  inside the site's namespace, where ``ip netns exec`` mounts that namespace's sysfs).

Socket counts are TCP payload (Gloo's framing adds a few bytes per message); interface counts
include Ethernet/IP/TCP headers (~4.6 % at MTU 1500) and the store's control traffic.  Without WAN
emulation there is no site address, so every byte counts as intra-site.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cpn.runtime.netem import ENV_SITE_ADDR

__all__ = [
    "ByteCount",
    "Meter",
    "classify",
    "cross_check",
    "interface_tx_bytes",
    "parse_ss",
    "socket_bytes_by_peer",
]

_PID_RE = re.compile(r"pid=(\d+),")
_SENT_RE = re.compile(r"\bbytes_sent:(\d+)")
_RETRANS_RE = re.compile(r"\bbytes_retrans:(\d+)")
_LOOPBACK = ("127.", "::1")


@dataclass(frozen=True)
class ByteCount:
    intra: int = 0
    wan: int = 0

    def __add__(self, other: ByteCount) -> ByteCount:
        return ByteCount(self.intra + other.intra, self.wan + other.wan)

    def __sub__(self, other: ByteCount) -> ByteCount:
        return ByteCount(self.intra - other.intra, self.wan - other.wan)

    def scaled(self, factor: float) -> ByteCount:
        return ByteCount(round(self.intra * factor), round(self.wan * factor))


def _peer_ip(column: str) -> str:
    host = column.rsplit(":", 1)[0].strip("[]")
    return host.removeprefix("::ffff:")


def socket_bytes_by_peer(pid: int | None = None) -> dict[tuple[str, str], int]:
    """``{(local, peer): payload bytes sent}`` for the TCP sockets ``pid`` (default: this process) owns."""
    return parse_ss(_ss(), os.getpid() if pid is None else pid)


def _ss() -> str:
    return subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=30, check=True).stdout


def _field(pattern: re.Pattern[str], line: str) -> int:
    m = pattern.search(line)
    return int(m.group(1)) if m else 0


def parse_ss(text: str, pid: int, *, retransmitted: bool = False) -> dict[tuple[str, str], int]:
    """Parse ``ss -tinpH``: a socket line (owner in ``users:``) followed by an indented info line.

    Payload bytes (sent less retransmitted) per socket, or with ``retransmitted`` the bytes sent again."""
    counts: dict[tuple[str, str], int] = {}
    owner: tuple[str, str] | None = None
    for line in text.splitlines():
        if line and not line[0].isspace():
            cols = line.split()
            pids = {int(p) for p in _PID_RE.findall(line)}
            owner = (cols[3], cols[4]) if pid in pids and len(cols) >= 5 else None
        elif owner is not None:
            again = _field(_RETRANS_RE, line)
            counts[owner] = again if retransmitted else _field(_SENT_RE, line) - again
            owner = None
    return counts


def classify(counts: dict[tuple[str, str], int], site_addr: str | None) -> ByteCount:
    """Split socket counts into intra-site and WAN by the peer's address."""
    intra = wan = 0
    for (_, peer), n in counts.items():
        ip = _peer_ip(peer)
        if site_addr is None or ip == site_addr or ip.startswith(_LOOPBACK):
            intra += n
        else:
            wan += n
    return ByteCount(intra, wan)


def interface_tx_bytes(ifname: str | None = None) -> int | None:
    """Bytes sent on the site's WAN veth (``GLOO_SOCKET_IFNAME``), or None without emulation."""
    ifname = ifname or os.environ.get("GLOO_SOCKET_IFNAME")
    path = Path("/sys/class/net") / str(ifname) / "statistics" / "tx_bytes"
    return int(path.read_text()) if ifname and path.exists() else None


class Meter:
    """Snapshots of this rank's socket counters and its site's veth, to diff around a window.

    Sockets of one pair live as long as the process group, so per-socket deltas are exact; a
    socket opened inside the window counts from zero.
    """

    def __init__(self, site_addr: str | None = None, ifname: str | None = None) -> None:
        self.site_addr = site_addr or os.environ.get(ENV_SITE_ADDR)
        self.ifname = ifname or os.environ.get("GLOO_SOCKET_IFNAME")
        self._sockets: dict[tuple[str, str], int] = {}
        self._again: dict[tuple[str, str], int] = {}
        self._iface: int | None = None
        self.retransmitted = ByteCount()  # bytes TCP sent again in the last window: on the wire, not payload

    def start(self) -> None:
        self._sockets, self._again = self._snapshot()
        self._iface = interface_tx_bytes(self.ifname)

    def stop(self) -> tuple[ByteCount, int | None]:
        """(this rank's socket bytes since :meth:`start`, the site veth's tx bytes since then)."""
        now, again = self._snapshot()
        iface = interface_tx_bytes(self.ifname)
        self.retransmitted = classify(_since(again, self._again), self.site_addr)
        iface_delta = iface - self._iface if iface is not None and self._iface is not None else None
        return classify(_since(now, self._sockets), self.site_addr), iface_delta

    @staticmethod
    def _snapshot() -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
        text, pid = _ss(), os.getpid()
        return parse_ss(text, pid), parse_ss(text, pid, retransmitted=True)


def _since(now: dict[tuple[str, str], int], then: dict[tuple[str, str], int]) -> dict[tuple[str, str], int]:
    return {k: n - then.get(k, 0) for k, n in now.items()}


def cross_check(
    counted: ByteCount, measured: ByteCount, rel: float = 0.05, slack: int = 64 * 1024
) -> list[str]:
    """Where the algorithm's count and the kernel's disagree beyond ``rel`` plus ``slack`` bytes."""
    problems = []
    for name in ("intra", "wan"):
        c, m = getattr(counted, name), getattr(measured, name)
        if abs(c - m) > rel * max(c, m) + slack:
            problems.append(f"{name}: algorithm counted {c} bytes, kernel measured {m}")
    return problems
