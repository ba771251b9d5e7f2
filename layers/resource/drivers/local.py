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
When the agent is root, each job's workers run as a uid of their own in a private mount namespace
(:mod:`cpn.runtime.sandbox`: the folders' owners and modes are drawn there), and a job's folder is
deleted, its uid given back and any process left running as it killed, once its runs have ended and
were reported (``keep_runs`` keeps them for inspection; a run whose outputs the server never
confirmed is kept, so that nothing trained is lost).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cpn.runtime import sandbox
from cpn.runtime.contract import ENV, AttemptSpec
from layers.resource.drivers.base import LogLine, SubtaskState

log = logging.getLogger("cpn.agent")

RUNNER_DONE = ("Finished", "Cancelled", "Error", "TimedOut")
MAX_LOG_BYTES = 256 * 1024  # per poll and rank: a chatty worker cannot flood the agent's report
RUNNER_MODULE = "cpn.runtime.jobrunner"
AGENT_SECRETS = frozenset({"CPN_TOKEN", "CPN_TOKEN_FILE", ENV.METRICS_TOKEN})  # the provider's token and its file


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

    def __init__(self, state_dir: Path, env: dict[str, str] | None = None, *, keep_runs: bool = False,
                 isolate: bool | None = None):
        """`isolate`: run each job as a uid of its own (default: when the agent is root)."""
        self.state_dir, self.env, self.keep_runs = state_dir, env or {}, keep_runs
        self.isolate = sandbox.available() if isolate is None else isolate
        if not self.isolate:
            log.warning("local driver: %s", sandbox.no_sandbox_warning())

    def _folders(self, directory: Path) -> sandbox.RunAs | None:
        """The job's folder, its attempt's and the run's, owned as the sandbox draws them."""
        job_dir = directory.parent.parent
        runs = job_dir.parent
        runs.mkdir(parents=True, exist_ok=True)
        if not self.isolate:
            directory.mkdir(parents=True, exist_ok=True)
            return None
        os.chmod(runs, 0o711)
        job_dir.mkdir(mode=0o700, exist_ok=True)
        run_as = sandbox.allocate(job_dir)
        sandbox.own(job_dir, run_as, 0o2750)
        sandbox.own(directory.parent, run_as, 0o2750)
        sandbox.own(directory, run_as, 0o3770)
        return run_as

    async def launch(self, spec: AttemptSpec) -> dict[str, Any]:
        directory = run_dir(self.state_dir, spec)
        handle = {"runDir": str(directory)}
        run_as = self._folders(directory)
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
                                    env=runner_env(dict(os.environ), {**self.env, **_run_as_env(run_as)}))
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

    async def cleanup(self, spec: AttemptSpec, handle: dict[str, Any]) -> bool:
        """Delete a run that has ended and was reported, and its job's folder with the last one (its
        uid's processes killed, the uid given back). False only while its runner still runs (ask
        again); a run kept on purpose (``keep_runs``, outputs the server never confirmed) is done."""
        directory = Path(handle["runDir"])
        if self.keep_runs or not directory.exists():
            return True
        if runner_pid(directory) is not None:
            return False
        status = _read_json(directory / "status.json") or {}
        if status.get("outputs") == "unsaved":
            log.warning("keeping %s: it holds outputs the server did not confirm (%s)", directory,
                        status.get("message", ""))
            return True
        shutil.rmtree(directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            directory.parent.rmdir()  # the attempt's folder, once empty
        job_dir = directory.parent.parent
        if any(job_dir.glob("attempt-*/*")):
            return True
        run_as = sandbox.RunAs.parse(_read_text(job_dir / ".run-as"))
        if run_as is not None:
            sandbox.kill_all(run_as.uid)  # anything the job's code left behind, in any session
        shutil.rmtree(job_dir, ignore_errors=True)
        if run_as is not None:
            sandbox.release(run_as, job_dir)
        return True

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


def _run_as_env(run_as: sandbox.RunAs | None) -> dict[str, str]:
    return {sandbox.ENV_RUN_AS: str(run_as)} if run_as is not None else {}


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _message(codes: dict[str, Any]) -> str:
    bad = {r: c for r, c in codes.items() if c not in (None, 0)}
    return f"workers exited: {bad}" if bad else ""


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
