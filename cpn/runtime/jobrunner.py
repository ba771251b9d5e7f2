"""The job runner: starts one job attempt's workers on this machine, site by site, watches them,
relays their metrics to the orchestrator and writes per-site status for it to read.

It is what the `local` site driver starts (detached, so it outlives an API-server restart). It
knows nothing of the database: its input is a spec file, its output `status.json` and the logs in
its run directory, and metric batches POSTed to the orchestrator with a per-job worker token.

    python -m cpn.runtime.jobrunner RUN_DIR      # RUN_DIR/runner.json is the spec
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cpn.runtime.config import ENV_CHECKPOINT_DIR, ENV_RUN_DIR, TrainConfig
from cpn.runtime.topology import Topology

KILLED_EXIT_CODES = frozenset({-9, -15, 137, 143, 75})


class SiteLaunch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int = Field(ge=0)
    subtask: str


class RunnerSpec(BaseModel):
    """Everything one attempt needs; written by the site driver as RUN_DIR/runner.json."""

    model_config = ConfigDict(extra="forbid")

    job: str
    attempt: int = Field(ge=1)
    topology: Topology
    train: TrainConfig
    sites: list[SiteLaunch]
    master_port: int = Field(gt=0, lt=65536)
    metrics_url: str | None = None
    metrics_token: str | None = None
    checkpoint_dir: str
    elastic: bool = True
    wan_emulation: bool = False
    timeout_seconds: float = Field(default=3600.0, gt=0)


@dataclass
class Worker:
    rank: int
    site: int
    proc: subprocess.Popen[bytes]
    exit_code: int | None = None


@dataclass
class Relay:
    """Tails each rank's metrics file and POSTs new lines in batches."""

    run_dir: Path
    url: str | None
    token: str | None
    offsets: dict[int, int] = field(default_factory=dict)
    pending: list[dict[str, Any]] = field(default_factory=list)

    def collect(self, ranks: list[int]) -> None:
        for rank in ranks:
            path = self.run_dir / "metrics" / f"rank{rank}.jsonl"
            if not path.exists():
                continue
            with path.open("rb") as fh:
                fh.seek(self.offsets.get(rank, 0))
                data = fh.read()
            end = data.rfind(b"\n") + 1
            self.offsets[rank] = self.offsets.get(rank, 0) + end
            for line in data[:end].splitlines():
                with contextlib.suppress(ValueError):
                    self.pending.append(json.loads(line))

    def flush(self) -> None:
        if not self.url or not self.pending:
            self.pending.clear()
            return
        body = json.dumps({"reports": self.pending[:500]}).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url, body, headers, method="POST"), timeout=10):
                pass
        except Exception as exc:  # noqa: BLE001 - the orchestrator may be restarting; keep and retry
            print(f"metrics relay: {exc}", file=sys.stderr, flush=True)
            self.pending = self.pending[-5000:]
            return
        del self.pending[:500]


def _env(spec: RunnerSpec, rank: int, run_dir: Path, master: str, extra: dict[str, str]) -> dict[str, str]:
    topo = spec.topology
    site = topo.site_of(rank)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env.pop("CPN_METRICS_URL", None)  # the runner relays; workers only write their files
    env.update(RANK=str(rank), WORLD_SIZE=str(topo.world_size), LOCAL_RANK=str(topo.local_rank(rank)),
               LOCAL_WORLD_SIZE=str(topo.sites[site].ranks), GROUP_RANK=str(site), MASTER_ADDR=master,
               MASTER_PORT=str(spec.master_port), PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               **topo.to_env(), **spec.train.to_env())
    env[ENV_RUN_DIR] = str(run_dir)
    env[ENV_CHECKPOINT_DIR] = spec.checkpoint_dir
    return env


def _start(spec: RunnerSpec, run_dir: Path, wan: Any) -> list[Worker]:
    master = wan.master_addr if wan else "127.0.0.1"
    workers = []
    wanted = {s.index for s in spec.sites}
    for rank in range(spec.topology.world_size):
        site = spec.topology.site_of(rank)
        if site not in wanted:
            continue
        extra = wan.env(site) if wan else {}
        argv = [sys.executable, "-m", "cpn.runtime.train"]
        argv = wan.wrap(site, argv) if wan else argv
        log_dir = run_dir / f"site-{site}"
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / f"rank{rank}.log", "ab") as log:
            proc = subprocess.Popen(argv, env=_env(spec, rank, run_dir, master, extra), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        workers.append(Worker(rank, site, proc))
    return workers


def _site_states(spec: RunnerSpec, workers: list[Worker], collateral: set[int]) -> list[dict[str, Any]]:
    """Per-site phase. A site the runner stopped because another failed is Cancelled, not Failed:
    the orchestrator must not blame it when it places the next attempt."""
    out = []
    for s in spec.sites:
        mine = [w for w in workers if w.site == s.index]
        codes = {str(w.rank): w.exit_code for w in mine}
        if any(c not in (None, 0) for c in codes.values()):
            phase = "Failed"
        elif all(c == 0 for c in codes.values()):
            phase = "Succeeded"
        else:
            phase = "Running"
        if phase == "Failed" and s.index in collateral:
            phase = "Cancelled"
        out.append({"index": s.index, "subtask": s.subtask, "phase": phase, "exitCodes": codes,
                    "pids": [w.proc.pid for w in mine]})
    return out


def _write_status(run_dir: Path, status: dict[str, Any]) -> None:
    tmp = run_dir / "status.tmp"
    tmp.write_text(json.dumps(status))
    os.replace(tmp, run_dir / "status.json")


def _kill(workers: list[Worker], sites: set[int] | None = None) -> None:
    for w in workers:
        if w.exit_code is None and (sites is None or w.site in sites):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGKILL)


def supervise(spec: RunnerSpec, run_dir: Path, wan: Any = None) -> str:
    """Run the attempt to its end; returns the runner's final phase."""
    workers = _start(spec, run_dir, wan)
    relay = Relay(run_dir, spec.metrics_url, spec.metrics_token)
    stop = {"why": None}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(why="Cancelled"))
    deadline = time.monotonic() + spec.timeout_seconds
    phase = "Running"
    collateral: set[int] = set()
    while True:
        for w in workers:
            if w.exit_code is None:
                w.exit_code = w.proc.poll()
        sites = _site_states(spec, workers, collateral)
        failed = {s["index"] for s in sites if s["phase"] == "Failed"}
        if failed:
            _kill(workers, failed)  # a site whose worker died is gone as a whole
            if not spec.elastic and not collateral:  # a synchronous job stops with its first failed site
                collateral = {s.index for s in spec.sites} - failed
                _kill(workers)
        if stop["why"] or time.monotonic() > deadline:
            phase = stop["why"] or "TimedOut"
            _kill(workers)
        relay.collect([w.rank for w in workers])
        relay.flush()
        done = all(w.exit_code is not None for w in workers)
        _write_status(run_dir, {"phase": "Finished" if done and phase == "Running" else phase,
                                "pid": os.getpid(), "job": spec.job, "attempt": spec.attempt, "sites": sites,
                                "at": time.time()})
        if done:
            break
        time.sleep(0.5)
    for _ in range(5):
        relay.collect([w.rank for w in workers])
        relay.flush()
        if not relay.pending or not relay.url:
            break
        time.sleep(1)
    return phase


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m cpn.runtime.jobrunner RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    spec = RunnerSpec.model_validate_json((run_dir / "runner.json").read_text())
    _write_status(run_dir, {"phase": "Starting", "pid": os.getpid(), "job": spec.job, "attempt": spec.attempt,
                            "sites": [], "at": time.time()})
    try:
        if spec.wan_emulation:
            from cpn.runtime.netem import WanEmulator

            with WanEmulator(spec.topology) as wan:
                supervise(spec, run_dir, wan)
        else:
            supervise(spec, run_dir)
    except Exception as exc:  # noqa: BLE001 - report, never leave the orchestrator guessing
        _write_status(run_dir, {"phase": "Error", "pid": os.getpid(), "job": spec.job, "attempt": spec.attempt,
                                "sites": [], "message": f"{type(exc).__name__}: {exc}", "at": time.time()})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
