"""The sandbox of a local site's workers: user code of one job cannot reach the agent, its token or other jobs.

When the agent runs as root, each job gets a uid (and a gid of the same number) of its own from a
range no account uses (``CPN_SANDBOX_UIDS``, default :data:`DEFAULT_UIDS`), taken machine-wide with
one lock file per uid under ``CPN_SANDBOX_DIR`` (every agent of the machine shares it) and given back
when the job's folder is deleted. The job runner stays the agent's user (it holds the worker token);
its workers run as the job's uid with no supplementary groups and no way to gain privileges
(``PR_SET_NO_NEW_PRIVS``), in a mount namespace of their own where every directory that the job's uid
could not traverse (``/root`` holding the Python installation, a 0700 state directory) is covered by
an empty tmpfs into which only what the workers need is bound back: Python, its import path and the
job's own folder. Another job's folder, the agent's state and the token file are then not even there.

    STATE/runs/<job>/                 root:G 2750  the job's folder: only the job's gid G may enter
                    checkpoints/      root:G 2770  the workers write step folders, the runner reads them
                    home/             U:G    0700  HOME, TMPDIR and caches of the workers
                    code/<digest>/    root:G 2750  the bundle, readable, not writable
                    attempt-<n>/<subtask>/
                                      root:G 3770  the workers' run directory (sticky: they cannot
                                                   replace the runner's spec.json 0600, status.json)

Without root there is no second uid: the workers then run as the agent's user, the agent is made
non-dumpable (its /proc/<pid>/environ and memory unreadable to them) and says so in its log.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import pwd
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

ENV_UIDS = "CPN_SANDBOX_UIDS"  # LO-HI: the uids jobs may run as
ENV_DIR = "CPN_SANDBOX_DIR"  # the machine-wide uid locks
ENV_RUN_AS = "CPN_RUN_AS"  # uid:gid, set by the driver in the job runner's environment
DEFAULT_UIDS = (3_000_000, 3_065_535)
DEFAULT_DIR = Path("/var/lib/cpn/sandbox")

_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 4, 4096, 16384, 1 << 18
_PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 4, 38


@dataclass(frozen=True)
class RunAs:
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"{self.uid}:{self.gid}"

    @classmethod
    def parse(cls, text: str | None) -> RunAs | None:
        if not text:
            return None
        uid, _, gid = text.partition(":")
        return cls(int(uid), int(gid or uid))


def available() -> bool:
    """Whether workers can run as a uid of their own here (the agent is root on Linux)."""
    return sys.platform.startswith("linux") and os.geteuid() == 0


def no_sandbox_warning() -> str:
    return ("workers run as the agent's own user, NOT sandboxed: run `cpn agent` as root to give each job "
            "a uid of its own (see docs/security.md); the agent is non-dumpable, so its environment and "
            "memory stay unreadable, but its files are not")


def make_undumpable() -> bool:
    """PR_SET_DUMPABLE 0: no core dumps, /proc/<pid>/environ, mem and ptrace only for root."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# ------------------------------------------------------------------------------ uids
def uid_range(environ: dict[str, str] | None = None) -> tuple[int, int]:
    raw = (os.environ if environ is None else environ).get(ENV_UIDS)
    if not raw:
        return DEFAULT_UIDS
    low, sep, high = raw.partition("-")
    if not (sep and low.strip().isdigit() and high.strip().isdigit()) or not 1000 <= int(low) <= int(high):
        raise ValueError(f"{ENV_UIDS}={raw!r}: write LO-HI with 1000 <= LO <= HI, e.g. 3000000-3065535")
    return int(low), int(high)


def _lock_dir() -> Path:
    path = Path(os.environ.get(ENV_DIR) or DEFAULT_DIR) / "uids"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def _uid_busy(uid: int) -> bool:
    """An account owns it, or a process runs as it (a lock lost with an orphan's folder)."""
    with contextlib.suppress(KeyError):
        pwd.getpwuid(uid)
        return True
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if proc.stat().st_uid == uid:
                    return True
    return False


def allocate(job_dir: Path) -> RunAs:
    """The uid of the job whose folder is `job_dir`: its own if it has one, else a free one of the
    range, locked machine-wide until :func:`release`."""
    mine = job_dir / ".run-as"
    with contextlib.suppress(FileNotFoundError, ValueError):
        found = RunAs.parse(mine.read_text().strip())
        if found is not None:
            return found
    low, high = uid_range()
    size = high - low + 1
    start = int(hashlib.sha256(str(job_dir).encode()).hexdigest(), 16) % size
    locks = _lock_dir()
    for i in range(size):
        uid = low + (start + i) % size
        lock = locks / str(uid)
        if lock.exists() and not _stale(lock):
            continue
        with contextlib.suppress(FileNotFoundError):
            lock.unlink() if lock.exists() else None
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            continue
        if _uid_busy(uid):  # keep it locked: never hand out a uid someone uses
            os.close(fd)
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(str(job_dir))
        run_as = RunAs(uid, uid)
        fd = os.open(mine, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(str(run_as))
        return run_as
    raise OSError(errno.EAGAIN, f"every uid of {ENV_UIDS} {low}-{high} is in use: widen the range")


def _stale(lock: Path) -> bool:
    """A lock whose job folder is gone and whose uid runs nothing (an agent died before it cleaned up)."""
    try:
        owner = Path(lock.read_text().strip())
    except OSError:
        return False
    return not owner.exists() and not _uid_busy(int(lock.name))


def release(run_as: RunAs, job_dir: Path) -> None:
    lock = _lock_dir() / str(run_as.uid)
    with contextlib.suppress(OSError):
        if Path(lock.read_text().strip()) == job_dir:
            lock.unlink()


# ------------------------------------------------------------------------------ folders
def own(path: Path, run_as: RunAs | None, mode: int, *, user: bool = False) -> Path:
    """Create `path` (if missing) with `mode`, group `run_as.gid` (owner its uid with `user`)."""
    path.mkdir(parents=True, exist_ok=True)
    if run_as is not None:
        os.chown(path, run_as.uid if user else -1, run_as.gid)
        os.chmod(path, mode)
    return path


def share_tree(root: Path, run_as: RunAs | None, *, writable: bool = False) -> None:
    """What the runner wrote for the workers, group-readable (a bundle) or also writable (the
    checkpoints a resumed attempt starts from, which it may write again)."""
    if run_as is None or not root.exists():
        return
    w = 0o020 if writable else 0
    for dirpath, _dirs, files in os.walk(root):
        os.chown(dirpath, -1, run_as.gid)
        os.chmod(dirpath, 0o2750 | w)
        for name in files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                os.chown(path, -1, run_as.gid)
                os.chmod(path, (st.st_mode & 0o700) | 0o040 | w | (0o010 if st.st_mode & 0o100 else 0))


PASS_ENV = frozenset({"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "CPN_SITE_ADDR", "CPN_SITE_ADDRS",
                      "CPN_AGENT_PORT_RANGE", "CPN_CACHE_DIR", "HOME", "TMPDIR", "PYTHONUNBUFFERED"})
PASS_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "NCCL_", "GLOO_", "TORCH_", "PYTORCH_", "OMP_", "MKL_")


def worker_base(environ: dict[str, str], home: Path | None) -> dict[str, str]:
    """The part of the runner's environment a worker may see: an allow-list (devices, network,
    locale), never a token or the agent's other settings; with a sandbox, HOME and TMPDIR its own."""
    base = {k: v for k, v in environ.items() if k in PASS_ENV or k.startswith(PASS_PREFIXES)}
    if home is not None:
        tmp = home / "tmp"
        base.update({"HOME": str(home), "TMPDIR": str(tmp), "CPN_CACHE_DIR": str(home / ".cache" / "cpn")})
    return base


# ------------------------------------------------------------------------------ the workers' side
def local_data(uri: str | None) -> list[Path]:
    """The folder of a dataset replica on this machine's disk (an absolute path or ``file://`` URI), else none."""
    if not uri or ("://" in uri and not uri.startswith("file://")):
        return []
    path = Path(uri[len("file://"):] if uri.startswith("file://") else uri.removeprefix("file:"))
    if not path.is_absolute() or not path.exists():
        return []
    return [path if path.is_dir() else path.parent]


def needed_paths(job_dir: Path, extra: list[Path] | None = None) -> list[Path]:
    """What a worker must reach: Python, its import path, the job's folder (and `extra`: its dataset's)."""
    paths = {Path(sys.executable).resolve().parent, Path(sys.prefix), Path(sys.base_prefix),
             Path(sys.exec_prefix), job_dir, *(extra or [])}
    paths |= {Path(p) for p in sys.path if p and Path(p).is_dir()}
    return sorted({p.resolve() for p in paths if p.exists()})


def _blocked(path: Path) -> Path | None:
    """The topmost directory on the way to `path` that others may not traverse."""
    for parent in reversed(path.parents):
        if parent != Path("/") and not os.stat(parent).st_mode & stat.S_IXOTH:
            return parent
    return None


def views(paths: list[Path]) -> dict[Path, list[Path]]:
    """Blocked directory → the needed paths under it: what to cover and what to bind back."""
    out: dict[Path, list[Path]] = {}
    paths = [p for p in paths if not any(q in p.parents for q in paths)]  # a bound folder brings its insides
    for path in paths:
        top = _blocked(path)
        if top is not None:
            out.setdefault(top, []).append(path)
    return out


def _check(ok: int, what: str) -> None:
    if ok != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter(run_as: RunAs, cover: dict[Path, list[Path]], cwd: Path) -> None:
    """In the worker's child before exec (as root): a private mount namespace where every blocked
    directory is an empty tmpfs holding only the needed paths, then the job's uid for good."""
    libc = ctypes.CDLL(None, use_errno=True)
    _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    os.umask(0)
    for top, inner in sorted(cover.items(), key=lambda kv: len(kv[0].parts)):
        fds = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in inner]
        _check(libc.mount(b"tmpfs", str(top).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=0711"),
               f"mount tmpfs on {top}")
        for path, fd in zip(inner, fds, strict=True):
            for step in [*reversed(path.relative_to(top).parents), path.relative_to(top)]:
                if step != Path("."):
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(top / step, 0o711)
            _check(libc.mount(f"/proc/self/fd/{fd}".encode(), str(path).encode(), None, _MS_BIND | _MS_REC, None),
                   f"bind {path}")
            os.close(fd)
    os.setgroups([])
    os.setgid(run_as.gid)
    os.setuid(run_as.uid)
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.umask(0o077)
    os.chdir(cwd)


def kill_all(uid: int) -> int:
    """SIGKILL every process running as `uid` (a job's uid, when its folder is deleted); how many."""
    killed = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if proc.stat().st_uid == uid:
                os.kill(int(proc.name), 9)
                killed += 1
    return killed
