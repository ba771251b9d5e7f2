"""The local driver with real processes: the job runner and its workers never hold the provider's
token (read from /proc/PID/environ of the launched processes), and a stale runner.pid never makes
the driver signal a process that is not this run's job runner."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cpn.runtime.config import TrainConfig
from cpn.runtime.contract import AttemptSpec, Endpoint
from cpn.runtime.launcher import free_port
from cpn.runtime.topology import Topology
from layers.resource.drivers.local import LocalDriver, run_dir, runner_argv, runner_env, runner_pid

PROVIDER_TOKEN = "cpn_provider_t0ps3cret"
WORKER_TOKEN = "cpn_worker_0nly"


def spec_of(job: str = "envcheck") -> AttemptSpec:
    return AttemptSpec(job=job, attempt=1, subtask=f"{job}-a", cluster="a", site_index=0, first_rank=0, workers=1,
                       topology=Topology(sites=[{"name": "a", "ranks": 1}]),
                       train=TrainConfig(model="tiny", tokens=1 << 22), elastic=False,
                       rendezvous=Endpoint(host="127.0.0.1", port=free_port()), worker_token=WORKER_TOKEN)


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode().partition("=")[::2] for item in raw.split(b"\0") if item)


def wait_for(check: Callable[[], object], seconds: float = 60.0) -> object:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {seconds} s")


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_runner_env_drops_the_provider_token() -> None:
    env = runner_env({"CPN_TOKEN": PROVIDER_TOKEN, "PATH": "/bin"}, {"CPN_METRICS_TOKEN": "x", "GLOO_SOCKET_IFNAME": "v0"})
    assert env == {"PATH": "/bin", "GLOO_SOCKET_IFNAME": "v0"}


async def test_the_runner_and_its_workers_hold_no_provider_token(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPN_TOKEN", PROVIDER_TOKEN)  # the agent's own environment holds it
    driver, spec = LocalDriver(tmp_path), spec_of()
    handle = await driver.launch(spec)
    directory = Path(handle["runDir"])
    try:
        runner = runner_pid(directory)
        assert runner is not None
        deadline = time.monotonic() + 60
        while not (state := await driver.poll(spec, handle)).pids:
            assert time.monotonic() < deadline and state.phase in ("Launching", "Running"), state
            await asyncio.sleep(0.1)
        (worker,) = state.pids
        for pid in (runner, worker):
            env = environ(pid)
            assert "CPN_TOKEN" not in env and "CPN_METRICS_TOKEN" not in env
            assert not any(PROVIDER_TOKEN in v for v in env.values()), pid
        assert not any(WORKER_TOKEN in v for v in environ(worker).values())  # the runner relays for it
        assert environ(worker)["RANK"] == "0"
    finally:
        await driver.cancel(spec, handle)
    wait_for(lambda: runner_pid(directory) is None)
    assert (await driver.poll(spec, handle)).phase == "Cancelled"


async def test_cancel_never_signals_a_process_that_is_not_the_runs_runner(
        tmp_path: Path, stranger: subprocess.Popen[bytes]) -> None:
    driver, spec = LocalDriver(tmp_path), spec_of("stale")
    directory = run_dir(tmp_path, spec)
    directory.mkdir(parents=True)
    (directory / "runner.pid").write_text(str(stranger.pid))  # a pid the kernel gave to someone else
    assert runner_pid(directory) is None
    await driver.cancel(spec, {"runDir": str(directory)})
    time.sleep(0.2)
    assert stranger.poll() is None  # not signalled
    assert (await driver.poll(spec, {"runDir": str(directory)})).phase == "Lost"

    other = run_dir(tmp_path, spec_of("other"))  # a real runner's command line, but another run's folder
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *runner_argv(directory)[1:]])
    theirs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *runner_argv(other)[1:]])
    try:
        (directory / "runner.pid").write_text(str(theirs.pid))
        await driver.cancel(spec, {"runDir": str(directory)})
        time.sleep(0.2)
        assert theirs.poll() is None
        (directory / "runner.pid").write_text(str(ours.pid))
        assert runner_pid(directory) == ours.pid
        await driver.cancel(spec, {"runDir": str(directory)})
        assert ours.wait(timeout=10) == -signal.SIGTERM
    finally:
        for proc in (ours, theirs):
            proc.kill()
            proc.wait()
    assert os.path.exists(directory / "runner.pid")  # left for inspection; just never trusted again
