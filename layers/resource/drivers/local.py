"""The `local` driver: runs a job attempt's workers as processes on this machine through the
runtime's job runner (detached, so workers outlive an API-server restart), in emulated-WAN network
namespaces when the job asks for it and root allows."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from layers.resource.drivers.base import DriverError, JobLaunch, SubtaskLaunch, SubtaskState


def attempt_dir(job: JobLaunch) -> Path:
    return job.run_root / job.job / f"attempt-{job.attempt}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours is dead too
        waited, _ = os.waitpid(pid, os.WNOHANG)
        return waited == 0
    except ChildProcessError:
        return True


class LocalDriver:
    name = "local"

    async def launch(self, job: JobLaunch, subtasks: list[SubtaskLaunch]) -> dict[str, dict[str, Any]]:
        run_dir = attempt_dir(job)
        handles = {s.subtask: {"runDir": str(run_dir), "siteIndex": s.site_index, "key": s.key} for s in subtasks}
        run_dir.mkdir(parents=True, exist_ok=True)
        try:  # the lock makes the launch happen once, whoever asks again and whenever
            fd = os.open(run_dir / "launch.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return handles
        with os.fdopen(fd, "w") as lock:
            lock.write(json.dumps({"keys": [s.key for s in subtasks]}))
        spec = {"job": job.job, "attempt": job.attempt, "topology": job.topology, "train": job.train,
                "sites": [{"index": s.site_index, "subtask": s.subtask} for s in subtasks],
                "master_port": job.master_port, "metrics_url": job.metrics_url, "metrics_token": job.metrics_token,
                "checkpoint_dir": str(job.run_root / job.job / "checkpoints"), "elastic": job.elastic,
                "wan_emulation": job.wan_emulation}
        (run_dir / "runner.json").write_text(json.dumps(spec))
        os.chmod(run_dir / "runner.json", 0o600)  # it holds the worker token
        with open(run_dir / "runner.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "cpn.runtime.jobrunner", str(run_dir)], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd=str(run_dir))
        (run_dir / "runner.pid").write_text(str(proc.pid))
        return handles

    async def poll(self, job: JobLaunch, handles: dict[str, dict[str, Any]]) -> dict[str, SubtaskState]:
        run_dir = attempt_dir(job)
        status = _read_json(run_dir / "status.json")
        pid = int((run_dir / "runner.pid").read_text()) if (run_dir / "runner.pid").exists() else None
        runner_alive = pid is not None and _alive(pid)
        by_index = {s["index"]: s for s in (status or {}).get("sites", [])}
        out = {}
        for subtask, handle in handles.items():
            site = by_index.get(handle["siteIndex"])
            if site is None:
                phase = "Launching" if runner_alive or status is None else "Lost"
                message = (status or {}).get("message", "") if phase == "Lost" else "starting workers"
                if status and status.get("phase") == "Error":
                    phase, message = "Failed", status.get("message", "runner error")
                out[subtask] = SubtaskState(phase=phase, message=message)
                continue
            phase = site["phase"]
            if phase == "Running" and not runner_alive:
                phase = "Lost"
            if status and status.get("phase") == "Cancelled" and phase not in ("Succeeded",):
                phase = "Cancelled"
            out[subtask] = SubtaskState(phase=phase, exit_codes=site.get("exitCodes", {}), pids=site.get("pids", []),
                                        message=_message(site))
        return out

    async def cancel(self, job: JobLaunch, handles: dict[str, dict[str, Any]]) -> None:
        pid_file = attempt_dir(job) / "runner.pid"
        if not pid_file.exists():
            return
        pid = int(pid_file.read_text())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)

    async def logs(self, handle: dict[str, Any], follow: bool = False) -> AsyncIterator[str]:
        site_dir = Path(handle["runDir"]) / f"site-{handle['siteIndex']}"
        offsets: dict[Path, int] = {}
        while True:
            for path in sorted(site_dir.glob("rank*.log")) if site_dir.exists() else []:
                with path.open("rb") as fh:
                    fh.seek(offsets.get(path, 0))
                    data = fh.read()
                end = data.rfind(b"\n") + 1
                offsets[path] = offsets.get(path, 0) + end
                for line in data[:end].decode(errors="replace").splitlines():
                    yield f"[{path.stem}] {line}"
            if not follow:
                return
            status = _read_json(Path(handle["runDir"]) / "status.json") or {}
            if status.get("phase") in ("Finished", "Cancelled", "Error", "TimedOut"):
                return
            await asyncio.sleep(0.5)


def _message(site: dict[str, Any]) -> str:
    codes = {r: c for r, c in site.get("exitCodes", {}).items() if c not in (None, 0)}
    return f"workers exited: {codes}" if codes else ""


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def driver_for(name: str) -> Any:
    if name == "local":
        return LocalDriver()
    if name == "kubernetes":
        from layers.resource.drivers.kubernetes import KubernetesDriver

        return KubernetesDriver()
    raise DriverError(f"no driver {name!r}")
