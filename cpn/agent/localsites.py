"""Several sites on one machine, each its own "machine": one `cpn agent --local` per cluster, and,
when run as root, each agent (and so its workers) in its own network namespace, joined to the API
server's namespace and to each other only through the emulated WAN (netns + tbf/htb). Control and
training traffic then really cross "the WAN". Used by `cpn demo` and the end-to-end tests.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cpn.runtime.netem import WanEmulator
from cpn.runtime.topology import LinkSpec, SiteSpec, Topology
from layers.resource.drivers.local import runner_pid


@dataclass(frozen=True)
class LocalCluster:
    name: str
    site: str
    token: str
    slots: int = 1


@dataclass
class LocalSites:
    """Context manager: the WAN (if `wan`) on enter, agents with `start()`, all gone on exit."""

    server_port: int
    clusters: list[LocalCluster]
    links: list[tuple[str, str, float]]  # site a, site b, Mbit/s
    state_root: Path
    wan: bool = False
    heartbeat_seconds: float = 2.0
    keep_runs: bool = False  # the agents keep each run's folder after it ended (tests that read them)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    emulator: WanEmulator | None = None

    @staticmethod
    def can_emulate() -> bool:
        return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None

    def __enter__(self) -> LocalSites:
        if self.wan:
            sites = sorted({c.site for c in self.clusters})
            topo = Topology(sites=[SiteSpec(name=s, ranks=1) for s in sites],
                            links=[LinkSpec(a=a, b=b, bandwidth_mbps=mbps) for a, b, mbps in self.links])
            self.emulator = WanEmulator(topo, join_host=True).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
        for pid_file in self.state_root.glob("*/runs/*/attempt-*/*/runner.pid"):  # runs left behind
            pid = runner_pid(pid_file.parent)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGTERM)
        if self.emulator is not None:
            self.emulator.__exit__(*exc)

    @property
    def server_host(self) -> str:
        """Where the API server must listen for the agents to reach it."""
        return self.emulator.host_addr if self.emulator else "127.0.0.1"

    @property
    def server_url(self) -> str:
        return f"http://{self.server_host}:{self.server_port}"

    def _site_index(self, site: str) -> int:
        assert self.emulator is not None
        return [s.name for s in self.emulator.topology.sites].index(site)

    def start(self, cluster: LocalCluster) -> subprocess.Popen[bytes]:
        """Start (or restart) the agent of `cluster`. Its token is in a 0600 file, not argv or environment."""
        state = self.state_root / cluster.name
        state.mkdir(parents=True, exist_ok=True)
        token_file = state / "token"
        fd = os.open(token_file, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(cluster.token + "\n")
        argv = [sys.executable, "-m", "cpn.cli.server", "agent", "--cluster", cluster.name, "--local",
                "--gpus", str(cluster.slots), "--server", self.server_url, "--interval", str(self.heartbeat_seconds),
                "--state-dir", str(state), "--token-file", str(token_file), *(["--keep-runs"] if self.keep_runs else [])]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for name in ("CPN_SERVER", "CPN_TOKEN", "CPN_TOKEN_FILE"):
            env.pop(name, None)
        if self.emulator is not None:
            index = self._site_index(cluster.site)
            env.update(self.emulator.env(index))
            argv = self.emulator.wrap(index, argv)
        log_dir = self.state_root / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / f"agent-{cluster.name}.log", "ab") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[cluster.name] = proc
        return proc

    def start_all(self) -> None:
        for cluster in self.clusters:
            self.start(cluster)

    def kill(self, name: str) -> None:
        """SIGKILL the agent only: its workers (detached) go on."""
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def stop(self, name: str) -> None:
        self.stop_all([name])

    def stop_all(self, names: list[str] | None = None) -> None:
        """SIGTERM the agents (all, or `names`) at once, then wait for them: each takes up to its poll
        interval to leave, one after the other that added up."""
        procs = [p for p in (self.procs.pop(n, None) for n in (list(self.procs) if names is None else names))
                 if p is not None and p.poll() is None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
