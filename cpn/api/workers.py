"""``cpn serve`` as several processes on one port (PostgreSQL; SQLite stays one process).

The parent upgrades the schema once, binds the listening socket and forks the workers; each runs
its own aiohttp application and event loop and accepts on the shared socket (the kernel spreads the
connections over them), so a burst of requests uses every CPU instead of one. The workers share
nothing in memory: tokens, rate limits, idempotency keys, quotes and the offer cache's stamps live
in the database, and one worker at a time runs the reconciler (the advisory lock of
``layers/orchestration/lifecycle/leader.py``). Prometheus counters are kept across the processes
(prometheus_client's multiprocess mode, in a directory the parent makes and removes), so
``/metrics`` on any worker counts every worker's requests.

A worker that dies takes the server down: the parent stops the others and exits with the worker's
status, for a supervisor (systemd, Kubernetes) to restart it whole. The workers die with the parent
(``PR_SET_PDEATHSIG``), so killing the parent never leaves them serving.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it when first imported
STOP_SECONDS = 30.0  # how long the parent waits for stopped workers before killing them
_PR_SET_PDEATHSIG = 1
log = logging.getLogger("cpn.api")
_made: list[str] = []  # the metrics directory prepare_metrics made (an operator's own is left alone)


def prepare_metrics(workers: int) -> None:
    """Before anything imports prometheus_client: with several workers, keep its values in files (in
    the operator's ``PROMETHEUS_MULTIPROC_DIR`` when set, else a directory :func:`run` removes at exit)."""
    if workers > 1 and not os.environ.get(MULTIPROC_ENV):
        _made.append(tempfile.mkdtemp(prefix="cpn-metrics-"))
        os.environ[MULTIPROC_ENV] = _made[-1]


def shared_metrics() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


def bind(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening sockets for every address ``host`` resolves to (as aiohttp binds them: ``localhost``
    gives IPv4 and IPv6, ``::`` IPv6 only)."""
    socks: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    for family, kind, proto, _, address in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE):
        if (family, address) in seen:
            continue
        seen.add((family, address))
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(address)
        except OSError:
            sock.close()
            for other in socks:
                other.close()
            raise
        sock.listen(backlog)
        socks.append(sock)
    return socks


def worker_pids(pid: int) -> list[int]:
    """The processes ``pid`` forked (a server's workers), from /proc; none where there is no such process."""
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def run(workers: int, socks: list[socket.socket], start: Callable[[list[socket.socket], int], None]) -> int:
    """Fork ``workers`` processes running ``start(socks, index)``; the exit status of the server."""
    children: dict[int, int] = {}
    for index in range(workers):
        pid = os.fork()
        if pid == 0:
            _child(socks, index, start)
        children[pid] = index
    for sock in socks:
        sock.close()
    stopping: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopping.append(signum)
        _stop_all(children)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    status = 0
    try:
        while children:
            pid, raw = os.wait()
            index = children.pop(pid, None)
            if index is None:
                continue
            _mark_dead(pid)
            code = os.waitstatus_to_exitcode(raw)
            if not stopping:  # a worker ended on its own: the server is not whole, stop it
                log.error("API worker %d (pid %d) exited with %d: stopping the server", index, pid, code)
                status = code if code > 0 else 1
                stopping.append(0)
                _stop_all(children)
    finally:
        for path in _made:
            shutil.rmtree(path, ignore_errors=True)
    return status


def _child(socks: list[socket.socket], index: int, start: Callable[[list[socket.socket], int], None]) -> None:
    code = 0
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the request took: do not serve alone
            raise SystemExit(0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        start(socks, index)
    except BaseException:  # noqa: BLE001 - the worker's end, whatever it was, is reported and becomes its status
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stop_all(children: dict[int, int]) -> None:
    """SIGTERM to every worker (a graceful stop), SIGKILL to those still there ``STOP_SECONDS`` later."""
    _signal_all(children, signal.SIGTERM)
    signal.signal(signal.SIGALRM, lambda *_: _signal_all(children, signal.SIGKILL))
    signal.alarm(int(STOP_SECONDS))


def _signal_all(children: dict[int, int], signum: int) -> None:
    for pid in list(children):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _mark_dead(pid: int) -> None:
    if shared_metrics():
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def migrate(url: str) -> None:
    """The schema upgrade, once, in the parent (the workers start with ``migrate=False``)."""
    from cpn.core.migrate import upgrade_async

    asyncio.run(upgrade_async(url))
