"""WAN emulation: namespaces, shaped veths, teardown on exit/crash/kill, and the root check."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from cpn.runtime import netem
from cpn.runtime.cli_collectives import netem_clean_cmd
from cpn.runtime.launcher import WorkerFailed, launch
from cpn.runtime.netem import NetemPermissionError, WanEmulator, clean, list_objects
from cpn.runtime.topology import LinkSpec, SiteSpec, Topology


def _mine(pid: int | None = None) -> list[str]:
    tag = str(pid or os.getpid())
    objs = list_objects()
    return [n for n in objs["netns"] + objs["links"] if n.startswith((f"cpnw-{tag}-", f"cpnw{tag}"))]


def _tc(*args: str) -> str:
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=True).stdout


def test_wan_needs_root_with_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetemPermissionError, match="needs root .* drop --wan-mbps"):
        launch(Topology.uniform(2, 1), "time:sleep", (0,), wan_mbps=100)


def test_namespaces_and_tbf_are_built_and_removed(root) -> None:
    with WanEmulator(Topology.uniform(3, 2), wan_mbps=100) as wan:
        assert len(_mine()) == 3 + 3 + 1  # namespaces, host veths, bridge
        inside = _tc("-n", wan.sites[1].netns, "qdisc", "show", "dev", wan.sites[1].veth_ns)
        assert "tbf" in inside and "100Mbit" in inside
        assert "tbf" in _tc("qdisc", "show", "dev", wan.sites[1].veth_host)
        env = wan.env(1)
        assert env["GLOO_SOCKET_IFNAME"] == wan.sites[1].veth_ns and wan.master_addr == wan.sites[0].ip
    assert _mine() == []


def test_catalogue_links_become_htb_classes_with_u32_filters(root) -> None:
    topo = Topology(
        sites=[
            SiteSpec(name="a", ranks=1, uplink_mbps=200),
            SiteSpec(name="b", ranks=1),
            SiteSpec(name="c", ranks=1),
        ],
        links=[LinkSpec(a="a", b="b", bandwidth_mbps=50), LinkSpec(a="a", b="c", bandwidth_mbps=20)],
    )
    with WanEmulator(topo) as wan:
        a = wan.sites[0]
        classes = _tc("-n", a.netns, "class", "show", "dev", a.veth_ns)
        assert "rate 50Mbit" in classes and "rate 20Mbit" in classes and "rate 200Mbit" in classes
        filters = _tc("-n", a.netns, "filter", "show", "dev", a.veth_ns)
        assert filters.count("flowid") == 2
    assert _mine() == []


def _crash() -> None:
    raise RuntimeError("boom")


def test_teardown_after_worker_crash(root) -> None:
    with pytest.raises(WorkerFailed, match="boom"):
        launch(Topology.uniform(2, 1), _crash, wan_mbps=100, capture_output=True, timeout=60, failure_grace=2)
    assert _mine() == []


def test_killed_launcher_leftovers_are_cleaned(root) -> None:
    """SIGKILL skips every finally block: the next clean() must recognise the dead owner."""
    code = (
        "from cpn.runtime.launcher import launch; from cpn.runtime.topology import Topology; "
        "launch(Topology.uniform(2, 1), 'time:sleep', (60,), wan_mbps=100)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    )
    try:
        deadline = time.monotonic() + 90
        while len(_mine(proc.pid)) != 5 and time.monotonic() < deadline:  # 2 netns, 2 veths, bridge
            time.sleep(0.2)
        assert len(_mine(proc.pid)) == 5, "the launcher never built its namespaces"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _mine(proc.pid)
    result = CliRunner().invoke(netem_clean_cmd, [])
    assert result.exit_code == 0, result.output
    assert _mine(proc.pid) == []  # (a concurrent run's own stale sweep may have beaten us to it)


def test_clean_keeps_live_runs_unless_all(root) -> None:
    with WanEmulator(Topology.uniform(2, 1), wan_mbps=100) as wan:
        clean(stale_only=True)
        assert len(_mine()) == 5
        removed = clean(stale_only=False, owner=os.getpid())
        assert f"netns {wan.sites[0].netns}" in removed and _mine() == []


def test_list_objects_ignores_foreign_names(root, monkeypatch) -> None:
    fake = {"stdout": json.dumps([{"ifname": "cpnwhatever"}, {"ifname": "cpnw12h0"}, {"ifname": "eth0"}])}
    real_run = netem._run

    def run(*argv, check=True):
        if argv[:3] == ("ip", "-j", "link"):
            return subprocess.CompletedProcess(argv, 0, fake["stdout"], "")
        return real_run(*argv, check=check)

    monkeypatch.setattr(netem, "_run", run)
    assert list_objects()["links"] == ["cpnw12h0"]


def _timed_allreduce(mb: int) -> float:
    import torch
    import torch.distributed as dist

    from cpn.runtime.collectives import allreduce
    from cpn.runtime.groups import init_groups, shutdown

    init_groups()
    x = torch.ones(mb * 2**18)
    allreduce(x, algorithm="flat")
    dist.barrier()
    seconds = allreduce(x, algorithm="flat").seconds
    shutdown()
    return seconds


def test_shaped_wan_is_really_slow(root, run_workers) -> None:
    """2 MiB between two single-rank sites at 40 Mbit/s: the bound is 2 MiB*8/40e6 = 0.42 s."""
    seconds = max(run_workers(2, 1, _timed_allreduce, 2, wan_mbps=40))
    assert 0.8 * 0.42 < seconds < 3.0


def test_each_emulator_takes_a_free_subnet(monkeypatch) -> None:
    """Two emulations on one machine (a demo beside a test run) must not share the bridge's /24."""
    taken = [{"ifname": "cpnw1br", "addr_info": [{"local": f"10.231.{n}.254"}]} for n in range(250) if n != 77]
    monkeypatch.setattr(netem, "_run", lambda *a, **k: subprocess.CompletedProcess(a, 0, json.dumps(taken), ""))
    assert netem._free_subnet() == "10.231.77"
    monkeypatch.setattr(netem.os, "getpid", lambda: 1005)
    taken = [{"ifname": "cpnw9br", "addr_info": [{"local": "10.231.5.254"}, {"local": "10.231.6.1"}]}]
    assert netem._free_subnet() == "10.231.7"  # starts from the pid's pick (1005 % 250 = 5), skips the used
