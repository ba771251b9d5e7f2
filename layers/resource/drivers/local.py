"""The `local` driver: runs a sub-task's workers as processes on the agent's machine through the
runtime's job runner — detached, so the workers outlive an agent that is killed, and a restarted
agent finds them again from the run directories under its state directory.

    STATE/runs/<job>.<uid8>/attempt-<n>/<subtask>/spec.json     the contract (0600: it holds the worker token)
                                          /runner.pid    the job runner's pid (trusted only while that
                                                         process's command line still names this folder)
                                          /status.json   what the runner reports (phase, exit codes)
                                          /site-<i>/rank<r>.log
    STATE/runs/<job>.<uid8>/checkpoints/                  this site's copy of the job's checkpoints

The runner gets the agent's environment without the provider's token: it reads the per-attempt
worker token from spec.json, and its workers get neither (:func:`cpn.runtime.contract.worker_env`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cpn.runtime.contract import ENV, AttemptSpec
from layers.resource.drivers.base import LogLine, SubtaskState

RUNNER_DONE = ("Finished", "Cancelled", "Error", "TimedOut")
MAX_LOG_BYTES = 256 * 1024  # per poll and rank: a chatty worker cannot flood the agent's report
RUNNER_MODULE = "cpn.runtime.jobrunner"
AGENT_SECRETS = frozenset({"CPN_TOKEN", ENV.METRICS_TOKEN})  # the provider's token (`cpn agent` reads CPN_TOKEN)


def run_dir(state_dir: Path, spec: AttemptSpec) -> Path:
    folder = f"{spec.job}.{spec.job_uid[:8]}" if spec.job_uid else spec.job  # one folder per job, not per name
    # a job's name is "owner/name": one folder level each, as the agents' globs over runs/ expect
    return state_dir / "runs" / folder.replace("/", "_") / f"attempt-{spec.attempt}" / spec.subtask.replace("/", "_")


def runner_argv(directory: Path) -> list[str]:
    return [sys.executable, "-m", RUNNER_MODULE, str(directory)]


def runner_env(base: dict[str, str], extra: dict[str, str] | None = None) -> dict[str, str]:
    """The job runner's environment: the agent's, without the provider's token."""
    return {k: v for k, v in {**base, **(extra or {})}.items() if k not in AGENT_SECRETS}


def runner_pid(directory: Path) -> int | None:
    """The pid in `directory`/runner.pid while that process runs and is still this run's job runner
    (its command line ends with :func:`runner_argv`'s): a pid file outlives its process, and the
    kernel reuses pids, so a stale file must never make us signal a stranger."""
    try:
        pid = int((directory / "runner.pid").read_text())
    except (OSError, ValueError):
        return None
    if not pid_alive(pid):
        return None
    if not Path("/proc/self/cmdline").exists():  # no procfs: trust the file, as on any other system
        return pid
    for _ in range(50):  # empty while the process is between exec's new memory and its arguments
        try:
            argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            return None
        if argv:
            break
        time.sleep(0.01)
    return pid if argv[-3:] == runner_argv(directory)[1:] else None


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie child of ours counts as dead and is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        return waited == 0
    except ChildProcessError:
        return True


class LocalDriver:
    name = "local"

    def __init__(self, state_dir: Path, env: dict[str, str] | None = None):
        self.state_dir, self.env = state_dir, env or {}

    async def launch(self, spec: AttemptSpec) -> dict[str, Any]:
        directory = run_dir(self.state_dir, spec)
        handle = {"runDir": str(directory)}
        directory.mkdir(parents=True, exist_ok=True)
        try:  # the lock makes the launch happen once, whoever asks again and whenever
            fd = os.open(directory / "launch.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return handle
        with os.fdopen(fd, "w") as lock:
            lock.write(json.dumps({"job": spec.job, "attempt": spec.attempt, "subtask": spec.subtask}))
        spec_path = directory / "spec.json"
        fd = os.open(spec_path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(spec.model_dump_json())
        with open(directory / "runner.log", "ab") as log:
            proc = subprocess.Popen(runner_argv(directory), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=str(directory),
                                    env=runner_env(dict(os.environ), self.env))
        (directory / "runner.pid").write_text(str(proc.pid))
        return handle

    async def poll(self, spec: AttemptSpec, handle: dict[str, Any]) -> SubtaskState:
        directory = Path(handle["runDir"])
        status = _read_json(directory / "status.json") or {}
        alive = runner_pid(directory) is not None
        runner = status.get("phase")
        if runner == "Error":
            return SubtaskState("Failed", status.get("message", "the job runner failed"))
        if runner is None:
            return SubtaskState("Launching" if alive else "Lost",
                                "starting workers" if alive else "the job runner died before it started")
        phase = status.get("subtask", {}).get("phase", "Launching")
        codes = status.get("subtask", {}).get("exitCodes", {})
        if phase in ("Running", "Launching") and not alive and runner not in RUNNER_DONE:
            phase = "Lost"
        if runner == "Cancelled" and phase != "Succeeded":
            phase = "Cancelled"
        return SubtaskState(phase, status.get("message") or _message(codes), codes,
                            status.get("subtask", {}).get("pids", []))

    async def cancel(self, spec: AttemptSpec, handle: dict[str, Any]) -> None:
        pid = runner_pid(Path(handle["runDir"]))
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    async def adopt(self) -> list[tuple[AttemptSpec, dict[str, Any]]]:
        found = []
        for spec_path in sorted((self.state_dir / "runs").glob("*/attempt-*/*/spec.json")):
            with contextlib.suppress(ValueError, OSError):
                found.append((AttemptSpec.model_validate_json(spec_path.read_text()),
                              {"runDir": str(spec_path.parent)}))
        return found

    async def logs(self, spec: AttemptSpec, handle: dict[str, Any],
                   cursor: dict[str, Any]) -> tuple[list[LogLine], dict[str, Any]]:
        directory = Path(handle["runDir"]) / f"site-{spec.site_index}"
        out: list[LogLine] = []
        cursor = dict(cursor)
        for rank in spec.ranks:
            path = directory / f"rank{rank}.log"
            if not path.exists():
                continue
            offset = int(cursor.get(str(rank), 0))
            with path.open("rb") as fh:
                fh.seek(offset)
                data = fh.read(MAX_LOG_BYTES)
            end = data.rfind(b"\n") + 1
            if end == 0 and len(data) == MAX_LOG_BYTES:  # one enormous line: ship it cut
                end = len(data)
            cursor[str(rank)] = offset + end
            out += [LogLine(rank, line) for line in data[:end].decode(errors="replace").splitlines()]
        return out, cursor


def _message(codes: dict[str, Any]) -> str:
    bad = {r: c for r, c in codes.items() if c not in (None, 0)}
    return f"workers exited: {bad}" if bad else ""


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
