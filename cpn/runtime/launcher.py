"""Start S x W worker processes on this machine with a torchrun-compatible environment.

Each worker is ``python -m cpn.runtime.launcher`` with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``CPN_TOPOLOGY`` set; it imports the
entry point, calls it, and pickles the return value back.  An entry point is a callable defined at
module level (``pkg.mod:func`` works too), or a bare module path run like ``python -m pkg.mod args``.

With a WAN rate (``wan_mbps`` or the topology's), every site runs in its own network namespace
behind shaped veths (:class:`cpn.runtime.netem.WanEmulator`); the emulation is torn down on return,
on an exception, on Ctrl-C and on SIGTERM.  A failing worker does not hang the launch: the others
get ``failure_grace`` seconds to notice, then they are killed; the whole launch has a ``timeout``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import faulthandler
import importlib
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from cpn.runtime.contract import torchrun_env  # the one builder of the torchrun variables
from cpn.runtime.netem import WanEmulator
from cpn.runtime.topology import Topology

__all__ = ["ENV_PORT_RANGE", "LaunchError", "LaunchTimeout", "PortRange", "WorkerFailed", "WorkerResult",
           "agent_port_range", "free_port", "launch"]

ENV_SPEC = "CPN_LAUNCH_SPEC"
ENV_PORT_RANGE = "CPN_AGENT_PORT_RANGE"  # LO-HI: the agent's --port-range, read by its work loop and drivers
ENV_RESULT = "CPN_LAUNCH_RESULT"
_PR_SET_PDEATHSIG = 1
STACKS_SIGNAL = signal.SIGUSR1  # a worker writes every thread's stack to its log on it (faulthandler)
STACKS_SETTLE = 1.0  # seconds a hung worker gets to write its stacks before it is stopped


class LaunchError(RuntimeError):
    """A launch did not complete; ``results`` holds what each worker did."""

    def __init__(self, message: str, results: list[WorkerResult]) -> None:
        super().__init__(message)
        self.results = results


class WorkerFailed(LaunchError):
    """At least one worker exited non-zero."""


class LaunchTimeout(LaunchError):
    """The workers did not finish within the launch timeout."""


@dataclass
class WorkerResult:
    rank: int
    site: int
    exit_code: int | None
    result: Any = None
    log: str = ""
    stopped: str | None = None  # the launcher stopped it while it ran: "timeout" or "failure" (another rank's)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


@dataclass(frozen=True)
class PortRange:
    """The TCP ports a site opens between sites (`cpn agent --port-range LO-HI`), inclusive."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1024 <= self.low <= self.high <= 65535:
            raise ValueError(f"port range {self.low}-{self.high}: write LO-HI with 1024 <= LO <= HI <= 65535, "
                             "e.g. 29400-29499")

    @classmethod
    def parse(cls, text: str) -> PortRange:
        low, sep, high = text.strip().partition("-")
        if not (sep and low.strip().isdigit() and high.strip().isdigit()):
            raise ValueError(f"port range {text!r}: write LO-HI, e.g. 29400-29499")
        return cls(int(low), int(high))

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"


def agent_port_range(environ: Mapping[str, str] | None = None) -> PortRange | None:
    """The range `cpn agent --port-range` set for this agent and its runners (None: any free port)."""
    raw = (os.environ if environ is None else environ).get(ENV_PORT_RANGE)
    return PortRange.parse(raw) if raw else None


def free_port(port_range: PortRange | None = None) -> int:
    """A TCP port nobody listens on right now (for MASTER_PORT): any, or one of `port_range`, tried
    from a random place so that agents sharing a range rarely pick the same one. OSError when every
    port of the range is taken (the agent retries later)."""
    if port_range is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]
    size = port_range.high - port_range.low + 1
    start = random.randrange(size)
    for i in range(size):
        port = port_range.low + (start + i) % size
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise OSError(errno.EADDRINUSE, f"no free TCP port in --port-range {port_range}")


def _entry_ref(entrypoint: Callable[..., Any] | str) -> str:
    if isinstance(entrypoint, str):
        return entrypoint
    module, qualname = entrypoint.__module__, entrypoint.__qualname__
    if module == "__main__" or "<locals>" in qualname:
        raise ValueError(
            f"entry point {qualname} must be importable: define it at module level in an importable module"
        )
    return f"{module}:{qualname}"


class _Forked:
    """The slice of ``Popen`` the launcher uses, for a child made with ``os.fork``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]


@dataclass
class _Worker:
    rank: int
    site: int
    proc: subprocess.Popen[bytes] | _Forked
    result_path: Path
    log_path: Path | None
    stopped: str | None = None


class _Served(_Forked):
    """A worker forked by the fork server: not this process's child, so watched through its Process."""

    def __init__(self, proc: Any) -> None:
        super().__init__(proc.pid)
        self._proc = proc

    def poll(self) -> int | None:
        if self.returncode is None and not self._proc.is_alive():
            self.returncode = self._proc.exitcode
        return self.returncode


# what the fork server imports once, before it forks any worker
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "cpn.runtime.train"]


def _serve_fork(env: dict[str, str], log_path: Path | None) -> _Served:
    """A worker forked from multiprocessing's fork server: a fresh interpreter (exec'd, never forked from this
    one) that imported torch once. Forking this process itself copies whatever its other threads held at
    that instant (a test session's leftover threads, its OpenMP pool): such children hung at random in
    long runs, both survivors of the ps fail-over test twice in CI."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    proc = ctx.Process(target=_child, args=(env, log_path), daemon=True)
    proc.start()
    return _Served(proc)


def _fork(env: dict[str, str], log_path: Path | None) -> _Forked:
    """Fork a worker that shares this process's imports (tests: no 1-2 s torch import per rank)."""
    pid = os.fork()
    if pid:
        return _Forked(pid)
    _child(env, log_path)
    raise AssertionError("unreachable")  # _child exits


def _child(env: dict[str, str], log_path: Path | None) -> None:
    """In a forked worker: its own session and log, the job's environment, the entry point; then exit."""
    code = 1
    try:
        os.setsid()
        _die_with_parent()
        if log_path:
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            # Python's own streams too: a parent's may be redirected elsewhere (pytest's capture), and a
            # traceback written there would be missing from the worker's log
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        _one_thread_after_fork(env)
        code = _worker_main()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _one_thread_after_fork(env: Mapping[str, str]) -> None:
    """A forked worker honours its ``OMP_NUM_THREADS`` (1): the variable is read when OpenMP starts, which in a
    fork was in the parent, so the child would run the parent's intra-op pool -- threads the fork did not copy
    (GNU OpenMP is not fork-safe) and, where it works, 3 ranks x 2 threads on 2 cores. PyTorch's DataLoader
    sets its forked workers to one thread for the same reason."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(max(1, int(env.get("OMP_NUM_THREADS", "1") or 1)))


def _worker_env(
    topology: Topology, rank: int, port: int, master: str, extra: Mapping[str, str]
) -> dict[str, str]:
    site = topology.site_of(rank)
    env = {"OMP_NUM_THREADS": "1", **os.environ, **extra}
    env.update(torchrun_env(topology, rank, topology.local_rank(rank), topology.sites[site].ranks, master, port))
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def _argv(ref: str, args: Sequence[Any] | Mapping[str, Any]) -> list[str]:
    if ":" in ref:
        return [sys.executable, "-m", "cpn.runtime.launcher"]
    return [sys.executable, "-m", ref, *map(str, args)]


def _start(
    topology: Topology,
    ref: str,
    args: Sequence[Any] | Mapping[str, Any],
    rundir: Path,
    wan: WanEmulator | None,
    env: Mapping[str, str],
    capture: bool,
    fork: str | None,
) -> list[_Worker]:
    spec = rundir / "spec.pkl"
    spec.write_bytes(pickle.dumps({"entry": ref, "args": args}))
    port = free_port()
    master = wan.master_addr if wan else "127.0.0.1"
    workers = []
    for rank in range(topology.world_size):
        site = topology.site_of(rank)
        extra = {**env, ENV_SPEC: str(spec), ENV_RESULT: str(rundir / f"result{rank}.pkl")}
        if wan:
            extra.update(wan.env(site))
        argv = _argv(ref, args)
        argv = wan.wrap(site, argv) if wan else argv
        log_path = rundir / f"rank{rank}.log" if capture else None
        wenv = _worker_env(topology, rank, port, master, extra)
        if fork == "forkserver":
            proc: subprocess.Popen[bytes] | _Forked = _serve_fork(wenv, log_path)
        elif fork == "fork":
            proc = _fork(wenv, log_path)
        else:
            proc = _popen(argv, wenv, log_path)
        workers.append(_Worker(rank, site, proc, Path(extra[ENV_RESULT]), log_path))
    return workers


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when the launcher dies, even by SIGKILL (survives ``ip netns exec``)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _popen(argv: list[str], env: dict[str, str], log_path: Path | None) -> subprocess.Popen[bytes]:
    out = open(log_path, "wb") if log_path else None  # noqa: SIM115
    try:
        return subprocess.Popen(
            argv, env=env, stdout=out, stderr=out, start_new_session=True, preexec_fn=_die_with_parent
        )
    finally:
        if out:
            out.close()


def _kill(workers: list[_Worker], why: str | None, grace: float = 3.0) -> None:
    live = [w for w in workers if w.proc.poll() is None]
    for w in live:
        w.stopped = why or "launcher"
    if why == "timeout":
        _dump_stacks(live)
    for w in live:
        if w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        if w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGKILL)
            w.proc.wait()


def _dump_stacks(workers: list[_Worker]) -> None:
    """Ask each hung worker for its threads' stacks (written to its log): where it waited, for the report."""
    for w in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.proc.pid, STACKS_SIGNAL)
    time.sleep(STACKS_SETTLE)


def _wait(workers: list[_Worker], timeout: float, failure_grace: float) -> str | None:
    """Poll until all exit; returns why it gave up (timeout / failure), or None when all finished."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while any(w.proc.poll() is None for w in workers):
        now = time.monotonic()
        if failed_at is None and any(w.proc.returncode not in (None, 0) for w in workers):
            failed_at = now
        if failed_at is not None and now - failed_at > failure_grace:
            return "failure"
        if now > deadline:
            return "timeout"
        time.sleep(0.05)
    return None


def _collect(workers: list[_Worker]) -> list[WorkerResult]:
    results = []
    for w in workers:
        value = pickle.loads(w.result_path.read_bytes()) if w.result_path.exists() else None
        log = w.log_path.read_text(errors="replace")[-4000:] if w.log_path and w.log_path.exists() else ""
        results.append(WorkerResult(w.rank, w.site, w.proc.returncode, value, log, w.stopped))
    return results


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit so ``finally`` blocks tear the emulation down."""
    if sys.platform == "win32" or not _main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _seconds(t: float | timedelta) -> float:
    return t.total_seconds() if isinstance(t, timedelta) else float(t)


def launch(
    topology: Topology,
    entrypoint: Callable[..., Any] | str,
    args: Sequence[Any] | Mapping[str, Any] = (),
    wan_mbps: float | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | timedelta = timedelta(minutes=30),
    failure_grace: float = 10.0,
    capture_output: bool = False,
    check: bool = True,
    per_link: bool = True,
    start_method: Literal["spawn", "fork", "forkserver"] = "spawn",
    emulate_wan: bool | None = None,
) -> list[WorkerResult]:
    """Run ``entrypoint`` on ``topology.world_size`` local processes; results in rank order.

    ``args`` is passed as ``*args`` (a sequence) or ``**kwargs`` (a mapping) to a callable, or as
    command-line words to a module.  ``wan_mbps`` (default: the topology's) turns on WAN emulation,
    which needs root; ``emulate_wan=True`` turns it on with only the topology's per-site uplinks and
    per-link rates (``per_link``), ``False`` keeps it off.  ``check`` raises :class:`WorkerFailed`/:class:`LaunchTimeout` with the
    workers' results (``capture_output`` keeps each worker's log tail in them).  ``start_method="fork"``
    skips the interpreter start and torch import per worker (for tests); it cannot enter a namespace,
    needs a callable entry point, and must not be used once this process has initialised torch.distributed
    or runs other threads. ``"forkserver"`` forks from a clean server that imported torch once (what the
    tests use; a plain fork only where a worker must inherit this process's state, a test's patch).
    """
    ref = _entry_ref(entrypoint)
    rate = wan_mbps or topology.wan_mbps
    emulate = bool(rate) if emulate_wan is None else emulate_wan
    fork = start_method if start_method in ("fork", "forkserver") else None
    if fork and (emulate or ":" not in ref):
        raise ValueError(f"start_method={start_method!r} works only for callables without WAN emulation; use 'spawn'")
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sigterm_as_exit())
        rundir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cpn-launch-")))
        wan = stack.enter_context(WanEmulator(topology, rate, per_link=per_link)) if emulate else None
        workers = _start(topology, ref, args, rundir, wan, env or {}, capture_output, fork)
        why = "interrupted"
        try:
            why = _wait(workers, _seconds(timeout), failure_grace)
        finally:
            _kill(workers, why)
        results = _collect(workers)
    if check:
        _raise_for(why, results, timeout)
    return results


def _raise_for(why: str | None, results: list[WorkerResult], timeout: float | timedelta) -> None:
    bad = [r for r in results if not r.ok]
    if why == "timeout":
        raise LaunchTimeout(
            f"workers did not finish within {_seconds(timeout):.0f}s; raise the timeout", results
        )
    if bad:
        first = next((r for r in bad if r.stopped is None), bad[0])  # a rank that failed, not one stopped for it
        tail = f":\n{first.log[-2000:]}" if first.log else " (see its stderr above)"
        raise WorkerFailed(
            f"{len(bad)} of {len(results)} workers failed; rank {first.rank} exited {first.exit_code}{tail}",
            results,
        )


# ---------------------------------------------------------------------------- worker side
def _resolve(ref: str) -> Callable[..., Any]:
    module, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main() -> int:
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # the launcher's timeout asks where this hangs
    spec = pickle.loads(Path(os.environ[ENV_SPEC]).read_bytes())
    fn = _resolve(spec["entry"])
    args = spec["args"]
    try:
        value = fn(**args) if isinstance(args, Mapping) else fn(*args)
    except Exception:
        traceback.print_exc()
        return 1
    Path(os.environ[ENV_RESULT]).write_bytes(pickle.dumps(value))
    _leave_job()
    return 0


def _leave_job() -> None:
    """Destroy a process group the entry point left open: exiting with live Gloo pairs can abort."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(_worker_main())
