"""Emulate a WAN on one machine: a network namespace per site, joined to a bridge by shaped veths.

::

    [netns cpnw-<pid>-s0] cpnw<pid>n0 ==veth== cpnw<pid>h0 --+
    [netns cpnw-<pid>-s1] cpnw<pid>n1 ==veth== cpnw<pid>h1 --+-- bridge cpnw<pid>br
    ...

Ranks of one site share a namespace, so intra-site traffic stays on that namespace's loopback (fast)
and only inter-site traffic crosses the veths, which are rate-limited: ``tbf`` at the site uplink
rate on both ends, or — when the topology lists per-pair links — an ``htb`` class per destination
site (``u32`` filter on the destination IP) under the uplink rate.  A regional topology
(:meth:`Topology.regional`) lists a link for every pair of sites and no uplink, so each pair runs at
its own class's rate: metro links inside a region, long-haul links between regions.  ``tc netem`` is not available on
these machines, so latency is not emulated; the cost model in :mod:`cpn.runtime.costmodel` adds it.

Everything is named ``cpnw`` + the owning process id, so a run killed with SIGKILL leaves objects
that the next run (or ``cpn netem clean``) recognises as stale and removes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cpn.runtime.topology import Topology

__all__ = [
    "PREFIX",
    "NetemError",
    "NetemPermissionError",
    "SiteNet",
    "WanEmulator",
    "clean",
    "list_objects",
    "require_root",
]

log = logging.getLogger(__name__)

PREFIX = "cpnw"
NET = "10.231"  # each emulator takes a free /24 of 10.231.0.0/16, so two on one machine never collide
ENV_SITE_ADDRS = "CPN_SITE_ADDRS"
ENV_SITE_ADDR = "CPN_SITE_ADDR"
_NS_RE = re.compile(rf"^{PREFIX}-(\d+)-s\d+$")
_LINK_RE = re.compile(rf"^{PREFIX}(\d+)(?:h\d+|n\d+|br)$")
_FAST_MBPS = 100_000.0


class NetemError(RuntimeError):
    """Setting up or tearing down the emulated WAN failed; the message has the failing command."""


class NetemPermissionError(NetemError):
    """WAN emulation needs root (network namespaces, veths, qdiscs)."""


def require_root() -> None:
    if os.geteuid() != 0:
        raise NetemPermissionError(
            "--wan-mbps needs root to create network namespaces and shape veths; "
            "rerun as root (sudo) or drop --wan-mbps"
        )
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise NetemPermissionError("--wan-mbps needs iproute2 (`ip`, `tc`); install it or drop --wan-mbps")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetemError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")
    return proc


@dataclass(frozen=True)
class SiteNet:
    """One site's namespace and its end of the WAN."""

    index: int
    netns: str
    veth_host: str
    veth_ns: str
    ip: str

    def counters(self) -> tuple[int, int]:
        """(bytes the site sent to the WAN, bytes it received), read on the host end of its veth."""
        stats = Path("/sys/class/net") / self.veth_host / "statistics"
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


class WanEmulator:
    """Context manager: builds the namespaces and shaping on enter, removes them on exit.

    Names carry the process id, so one process runs one emulator at a time.
    """

    _active: set[int] = set()

    def __init__(
        self,
        topology: Topology,
        wan_mbps: float | None = None,
        per_link: bool = True,
        burst_kb: int = 256,
        latency_ms: int = 100,
        join_host: bool = False,
    ) -> None:
        self.join_host = join_host
        self.topology = topology
        self.wan_mbps = wan_mbps or topology.wan_mbps
        self.per_link = per_link and bool(topology.links)
        self.burst_kb = burst_kb
        self.latency_ms = latency_ms
        tag = f"{os.getpid()}"
        self.bridge = f"{PREFIX}{tag}br"
        self.subnet = _free_subnet()
        self.sites = [
            SiteNet(
                i, f"{PREFIX}-{tag}-s{i}", f"{PREFIX}{tag}h{i}", f"{PREFIX}{tag}n{i}", f"{self.subnet}.{i + 1}"
            )
            for i in range(topology.num_sites)
        ]
        self._up = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> WanEmulator:
        require_root()
        if os.getpid() in WanEmulator._active:
            raise NetemError(
                "this process already runs a WAN emulation; finish that launch before starting another"
            )
        clean(stale_only=True)
        WanEmulator._active.add(os.getpid())
        try:
            self._setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _setup(self) -> None:
        self._up = True
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        # the root namespace (the API server's machine) joins the WAN at HOST_IP: site agents reach the
        # server through their shaped veths, like a site behind its uplink would
        if self.join_host:
            _run("ip", "addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
        for site in self.sites:
            self._add_site(site)
        for site in self.sites:
            self._shape(site)

    def _add_site(self, s: SiteNet) -> None:
        _run("ip", "netns", "add", s.netns)
        _run("ip", "link", "add", s.veth_host, "type", "veth", "peer", "name", s.veth_ns)
        _run("ip", "link", "set", s.veth_ns, "netns", s.netns)
        _run("ip", "link", "set", s.veth_host, "master", self.bridge)
        _run("ip", "link", "set", s.veth_host, "up")
        _run("ip", "-n", s.netns, "addr", "add", f"{s.ip}/24", "dev", s.veth_ns)
        _run("ip", "-n", s.netns, "link", "set", s.veth_ns, "up")
        _run("ip", "-n", s.netns, "link", "set", "lo", "up")

    def teardown(self) -> None:
        """Remove this emulator's namespaces, veths and bridge; safe to call twice."""
        WanEmulator._active.discard(os.getpid())
        if not self._up:
            return
        for s in self.sites:
            _run("ip", "netns", "del", s.netns, check=False)
            _run("ip", "link", "del", s.veth_host, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        self._up = False

    # ------------------------------------------------------------------ shaping
    def uplink_mbps(self, site: int) -> float | None:
        return self.topology.sites[site].uplink_mbps or self.wan_mbps

    def _tbf(self, dev: str, mbps: float, netns: str | None = None) -> None:
        where = ("-n", netns) if netns else ()
        _run(
            "tc",
            *where,
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{mbps}mbit",
            "burst",
            f"{self.burst_kb}kb",
            "latency",
            f"{self.latency_ms}ms",
        )

    def _shape(self, s: SiteNet) -> None:
        up = self.uplink_mbps(s.index)
        if self.per_link:
            self._htb(s, up)
        elif up is not None:
            self._tbf(s.veth_ns, up, s.netns)
        if up is not None:
            self._tbf(s.veth_host, up)

    def _htb(self, s: SiteNet, up: float | None) -> None:
        """Per-destination classes under the uplink: one ``u32 match ip dst`` filter per peer site."""
        tc = ("tc", "-n", s.netns)
        rate = f"{up or _FAST_MBPS}mbit"
        burst = f"{self.burst_kb}kb"
        _run(*tc, "qdisc", "replace", "dev", s.veth_ns, "root", "handle", "1:", "htb", "default", "999")
        _run(
            *tc,
            "class",
            "add",
            "dev",
            s.veth_ns,
            "parent",
            "1:",
            "classid",
            "1:1",
            "htb",
            "rate",
            rate,
            "ceil",
            rate,
            "burst",
            burst,
            "cburst",
            burst,
        )
        _run(
            *tc,
            "class",
            "add",
            "dev",
            s.veth_ns,
            "parent",
            "1:1",
            "classid",
            "1:999",
            "htb",
            "rate",
            rate,
            "ceil",
            rate,
            "burst",
            burst,
            "cburst",
            burst,
        )
        me = self.topology.sites[s.index].name
        for peer in self.sites:
            link = self.topology.link(me, self.topology.sites[peer.index].name)
            if peer.index == s.index or link is None:
                continue
            pair = f"{min(link.bandwidth_mbps, up or _FAST_MBPS)}mbit"
            cls = f"1:{10 + peer.index}"
            _run(
                *tc,
                "class",
                "add",
                "dev",
                s.veth_ns,
                "parent",
                "1:1",
                "classid",
                cls,
                "htb",
                "rate",
                pair,
                "ceil",
                pair,
                "burst",
                burst,
                "cburst",
                burst,
            )
            _run(
                *tc,
                "filter",
                "add",
                "dev",
                s.veth_ns,
                "parent",
                "1:",
                "protocol",
                "ip",
                "prio",
                "1",
                "u32",
                "match",
                "ip",
                "dst",
                f"{peer.ip}/32",
                "flowid",
                cls,
            )

    def pair_rates(self) -> dict[tuple[int, int], float | None]:
        """What each (sender site, receiver site) pair is shaped to, Mbit/s (None: unshaped)."""
        out: dict[tuple[int, int], float | None] = {}
        for a in self.sites:
            up = self.uplink_mbps(a.index)
            for b in self.sites:
                if a.index == b.index:
                    continue
                names = (self.topology.sites[a.index].name, self.topology.sites[b.index].name)
                link = self.topology.link(*names) if self.per_link else None
                rates = [x for x in (up, link.bandwidth_mbps if link else None) if x is not None]
                out[(a.index, b.index)] = min(rates) if rates else None
        return out

    # ------------------------------------------------------------------ for the launcher
    @property
    def master_addr(self) -> str:
        return self.sites[0].ip

    @property
    def host_addr(self) -> str:
        """The root namespace's address on the emulated WAN (where a local API server listens)."""
        return f"{self.subnet}.254"

    def wrap(self, site: int, argv: list[str]) -> list[str]:
        """Run ``argv`` inside the site's namespace."""
        return ["ip", "netns", "exec", self.sites[site].netns, *argv]

    def env(self, site: int) -> dict[str, str]:
        """Env for a worker of ``site``: Gloo binds its veth; accounting learns the site addresses."""
        s = self.sites[site]
        return {
            "GLOO_SOCKET_IFNAME": s.veth_ns,
            ENV_SITE_ADDR: s.ip,
            ENV_SITE_ADDRS: json.dumps([x.ip for x in self.sites]),
        }

    def counters(self) -> list[tuple[int, int]]:
        return [s.counters() for s in self.sites]


# ---------------------------------------------------------------------- leftovers
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_subnet() -> str:
    """A /24 of :data:`NET` no interface of this machine uses (starting from one the pid picks, so two
    emulators started at once rarely even look at the same one)."""
    try:
        entries = json.loads(_run("ip", "-j", "addr", "show", check=False).stdout or "[]")
    except (OSError, ValueError):
        entries = []
    used = {int(a["local"].split(".")[2]) for e in entries for a in e.get("addr_info", [])
            if str(a.get("local", "")).startswith(NET + ".")}
    start = os.getpid() % 250
    third = next((n for n in ((start + k) % 250 for k in range(250)) if n not in used), start)
    return f"{NET}.{third}"


def list_objects() -> dict[str, list[str]]:
    """Every ``cpnw`` namespace and link on this machine."""
    ns = [
        line.split()[0]
        for line in _run("ip", "netns", "list", check=False).stdout.splitlines()
        if line.strip()
    ]
    links = [
        entry["ifname"]
        for entry in json.loads(_run("ip", "-j", "link", "show", check=False).stdout or "[]")
        if entry.get("ifname", "").startswith(PREFIX)
    ]
    return {"netns": [n for n in ns if _NS_RE.match(n)], "links": [lk for lk in links if _LINK_RE.match(lk)]}


def clean(stale_only: bool = True, owner: int | None = None) -> list[str]:
    """Remove ``cpnw`` objects: those whose owning process is gone (``stale_only``), or all of them;
    ``owner`` limits it to one process's objects."""
    removed = []
    objs = list_objects()
    for kind, pattern, names in (("netns", _NS_RE, objs["netns"]), ("link", _LINK_RE, objs["links"])):
        for name in names:
            pid = int(pattern.match(name).group(1))  # type: ignore[union-attr]
            if (owner is not None and pid != owner) or (stale_only and _alive(pid)):
                continue
            cmd = ("ip", "netns", "del", name) if kind == "netns" else ("ip", "link", "del", name)
            if _run(*cmd, check=False).returncode == 0:
                removed.append(f"{kind} {name}")
    if removed:
        log.info("removed WAN emulation objects: %s", ", ".join(removed))
    return removed
