"""The job runner: runs one sub-task of one job attempt at a site — its ranks of the job — watches
them, relays their metrics to the API, keeps the job's checkpoints in the API's blob store, and
writes `status.json` for the site agent to report.

One runner, two places. The `local` site driver starts it detached on the agent's machine, so it
outlives an agent restart. The `kubernetes` driver runs it as each pod's command, for the ranks of
that pod only (``--pod-index``, ``--ranks-per-pod``), reading the contract from the Secret mounted in
the pod; there it also copies every worker's output to its own stdout, each line prefixed with the
worker's global rank (:mod:`cpn.runtime.ranklog`), so the pod's log carries them, and exits with the first
failed worker's code. Either way it knows nothing of the database: its input is the attempt
contract, its outputs `status.json`, the rank logs in RUN_DIR/site-<i>/, metric batches, checkpoint
files and the final weights sent to the API with the per-attempt worker token.

    python -m cpn.runtime.jobrunner RUN_DIR                     # contract in RUN_DIR/spec.json
    python -m cpn.runtime.jobrunner RUN_DIR --contract PATH --job-dir DIR --pod-index I --ranks-per-pod N
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from cpn.runtime import bundle, checkpoint, sandbox
from cpn.runtime.config import FINAL_MODEL
from cpn.runtime.contract import ENV, AttemptSpec, worker_env
from cpn.runtime.ranklog import rank_prefix

DONE_MARK = ".cpn-bundle"
MAX_UNPACKED_BYTES = 2 * 1024**3

TIMEOUT_SECONDS = 7 * 24 * 3600.0
POLL_SECONDS = 0.5
ENV_OUTAGE_WINDOW = "CPN_OUTAGE_WINDOW_SECONDS"
OUTAGE_WINDOW_SECONDS = 300.0  # how long a run's end waits out an API, database or blob-store outage


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen[bytes]
    log: Path
    exit_code: int | None = None
    tee: threading.Thread | None = None


def _client(spec: AttemptSpec) -> httpx.Client | None:
    if not spec.server:
        return None
    headers = {"Authorization": f"Bearer {spec.worker_token}"} if spec.worker_token else {}
    return httpx.Client(base_url=spec.server.rstrip("/"), headers=headers, timeout=30.0)


@dataclass
class Relay:
    """Tails each rank's metrics file and POSTs new lines in batches."""

    run_dir: Path
    spec: AttemptSpec
    client: httpx.Client | None
    offsets: dict[int, int] = field(default_factory=dict)
    pending: list[dict[str, Any]] = field(default_factory=list)
    batch: tuple[str, int] | None = None  # the head batch in flight: (its id, how many reports), kept across retries

    def collect(self) -> None:
        for rank in self.spec.ranks:
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
        if self.client is None or not self.pending:
            self.pending.clear()
            return
        if self.batch is None:
            self.batch = (uuid.uuid4().hex, min(500, len(self.pending)))
        batch_id, count = self.batch
        try:
            response = self.client.post(f"{self.spec.job_path}/metrics",
                                        json={"reports": self.pending[:count], "batchId": batch_id})
            if response.status_code == 429 or response.status_code >= 500 or _stale(response):
                response.raise_for_status()
        except httpx.HTTPError as exc:  # the API may be restarting or busy: keep and retry
            print(f"metrics relay: {exc}", file=sys.stderr, flush=True)
            if len(self.pending) > 5000:
                self.pending, self.batch = self.pending[-5000:], None
            return
        if response.is_error:  # refused for good (the job ended, a bad report): retrying cannot help
            print(f"metrics relay: {response.status_code} {response.text[:200]}", file=sys.stderr, flush=True)
        del self.pending[:count]
        self.batch = None


def _stale(response: httpx.Response) -> bool:
    """A 409 because the job changed while the reports were written: nothing was kept, send them again."""
    if response.status_code != 409:
        return False
    try:
        return response.json()["error"]["code"] == "stale"
    except (ValueError, KeyError, TypeError):
        return False


DCP_SAVE_WAIT_SECONDS = 60.0  # how long a site's sharded files wait for rank 0's site to end their save


class DcpSavePending(httpx.TransportError):
    """This site's files of a sharded checkpoint wait for rank 0's site to upload the save's metadata:
    retried like an unreachable API (:func:`_transient`)."""


@dataclass
class CheckpointSync:
    """Copies this site's checkpoint files to the API's blob store, and fetches the newest complete
    checkpoint before a resumed attempt starts, so a re-placed attempt resumes at any site."""

    root: Path
    spec: AttemptSpec
    client: httpx.Client | None
    sent: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (mtime_ns, size) uploaded
    dcp_saved: set[str] = field(default_factory=set)  # sharded steps whose .metadata the API holds

    def _mark(self, name: str, path: Path) -> None:
        st = path.stat()
        self.sent[name] = (st.st_mtime_ns, st.st_size)

    def _unsent(self, name: str, path: Path) -> bool:
        """Not uploaded yet, or rewritten since (a resumed attempt saving a step again)."""
        st = path.stat()
        return self.sent.get(name) != (st.st_mtime_ns, st.st_size)

    def prune_after(self, step: int) -> None:
        """Drop this site's checkpoint folders newer than the step a new attempt resumes from: they
        belong to the abandoned run (never completed at the API), and must not be uploaded as this
        attempt's."""
        if not self.root.exists():
            return
        for folder in self.root.glob("step-*"):
            with contextlib.suppress(ValueError):
                if int(folder.name.removeprefix("step-")) > step:
                    shutil.rmtree(folder, ignore_errors=True)

    def _base(self) -> str:
        return f"{self.spec.job_path}/checkpoints"

    def fetch(self) -> int | None:
        """Download the newest complete checkpoint into `root`; its step, or None if there is none."""
        if self.client is None:
            info = checkpoint.latest(self.root)
            return info["step"] if info else None
        resp = self.client.get(f"{self._base()}/latest")
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        latest = resp.json()
        for name in latest["files"]:
            target = self.root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with self.client.stream("GET", f"{self._base()}/{name}") as r:
                r.raise_for_status()
                tmp = target.with_name(f".{target.name}.part")
                with tmp.open("wb") as fh:
                    for chunk in r.iter_bytes():
                        fh.write(chunk)
                os.replace(tmp, target)
            self._mark(name, target)
        info = {"step": latest["step"], "sites": latest["sites"]}
        if latest.get("format") == checkpoint.DCP_FORMAT:  # load_sharded reads the whole step's folder
            info.update(format=checkpoint.DCP_FORMAT, files=[name.rsplit("/", 1)[1] for name in latest["files"]])
        checkpoint.atomic_write_json(info, self.root / checkpoint.LATEST)
        return int(latest["step"])

    def _put(self, name: str, path: Path) -> None:
        with path.open("rb") as fh:
            self.client.put(f"{self._base()}/{name}", content=fh).raise_for_status()  # type: ignore[union-attr]
        self._mark(name, path)

    def _dcp_files(self) -> list[Path]:
        """The sharded (DCP) files this site wrote: its own ranks' ``__R_I.distcp``, and on rank 0's site
        the coordinator's ``.metadata`` (rank R of the save is global rank R: it runs on the world group)."""
        mine = {f"__{rank}_" for rank in self.spec.ranks}
        files = [p for p in self.root.glob("step-*/__*_*.distcp") if any(p.name.startswith(m) for m in mine)]
        if self.spec.leads_rendezvous:
            files += self.root.glob("step-*/.metadata")
        return sorted(files)

    def _saved(self, step: str) -> bool:
        """Whether the job-wide DCP save of `step` has ended: its ``.metadata`` exists (here, or at the
        API from rank 0's site). DCP writes a rank's file in place, and rank 0 writes the metadata only
        after every rank's files are whole, so a file uploaded before that may be half written."""
        if step in self.dcp_saved or (self.root / step / ".metadata").exists():
            return True
        with self.client.stream("GET", f"{self._base()}/{step}/.metadata") as resp:  # type: ignore[union-attr]
            if resp.status_code == 404:  # (the body is not read: only whether it is there)
                return False
            resp.raise_for_status()
        self.dcp_saved.add(step)
        return True

    def _push_dcp(self) -> None:
        """Upload this site's files of finished sharded saves. A file still waiting for its save's end
        (rank 0's site has not uploaded the metadata yet) raises :class:`DcpSavePending` while it is
        young, so the run's epilogue retries; an old one (rank 0's site died) is left behind."""
        waiting = []
        for path in self._dcp_files():
            name = f"{path.parent.name}/{path.name}"
            if not self._unsent(name, path):
                continue
            if path.name == ".metadata" or self._saved(path.parent.name):
                self._put(name, path)
            elif time.time() - path.stat().st_mtime < DCP_SAVE_WAIT_SECONDS:
                waiting.append(name)
        if waiting:
            raise DcpSavePending(f"waiting for rank 0's site to finish the sharded save of {', '.join(waiting)}")

    def push(self) -> None:
        if self.client is None or not self.root.exists():
            return
        for path in sorted(self.root.glob("step-*/*.pt")):
            name = f"{path.parent.name}/{path.name}"
            if self._unsent(name, path):
                self._put(name, path)
        pending: DcpSavePending | None = None
        try:
            self._push_dcp()
        except DcpSavePending as exc:
            pending = exc
        info = checkpoint.latest(self.root)
        if info and self.spec.leads_rendezvous:  # rank 0's site commits the step once its files are up
            marker = f"{checkpoint.step_dir(Path(''), info['step']).name}/{checkpoint.LATEST}"
            latest = self.root / checkpoint.LATEST
            if self._unsent(marker, latest):
                self.client.put(f"{self._base()}/{marker}", content=json.dumps(info).encode()).raise_for_status()
                self._mark(marker, latest)
        if pending is not None:
            raise pending


def _last_error(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


def fetch_code(spec: AttemptSpec, job_dir: Path, client: httpx.Client | None) -> Path | None:
    """The job's code bundle (``spec.code``), downloaded by digest with the worker token, verified and
    safely extracted into ``job_dir/code/<hex>`` (kept for later attempts); None for the built-in LM."""
    if spec.code is None:
        return None
    hexdigest = spec.code.digest.removeprefix("sha256:")
    target = job_dir / "code" / hexdigest
    if (target / DONE_MARK).exists():
        return target
    if client is None:
        raise RuntimeError("spec.code needs the API server to fetch the bundle from; this attempt has none")
    target.parent.mkdir(parents=True, exist_ok=True)
    archive = target.parent / f".{hexdigest}.{os.getpid()}.tar.gz"
    with client.stream("GET", f"/api/v1/bundles/{hexdigest}") as r:
        if r.status_code >= 400:
            r.read()
            raise RuntimeError(f"bundle {spec.code.digest} could not be fetched: HTTP {r.status_code} {r.text[:200]}")
        with archive.open("wb") as fh:
            for chunk in r.iter_bytes():
                fh.write(chunk)
    staging = target.parent / f".{hexdigest}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        bundle.extract(archive, staging, MAX_UNPACKED_BYTES, digest=spec.code.digest)
        (staging / DONE_MARK).write_text(spec.code.digest)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        archive.unlink(missing_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
    return target


def push_final(spec: AttemptSpec, run_dir: Path, client: httpx.Client | None) -> bool:
    """Rank 0's site uploads the final weights (``final_model.pt``) once the run has ended."""
    path = run_dir / FINAL_MODEL
    if client is None or not spec.leads_rendezvous or not path.exists():
        return False
    with path.open("rb") as fh:
        client.put(f"{spec.job_path}/final", content=fh).raise_for_status()
    return True


def _retain(sync: CheckpointSync, keep: int) -> None:
    """Drop this site's checkpoint steps beyond the newest `keep` once the server holds their files."""
    def uploaded(path: Path) -> bool:
        return not sync._unsent(str(path.relative_to(sync.root)), path)

    with contextlib.suppress(OSError):
        checkpoint.prune(sync.root, keep, uploaded=None if sync.client is None else uploaded)


@dataclass(frozen=True)
class Jail:
    """How the workers run: as the job's own uid in their own mount namespace (the local driver as
    root sets ``CPN_RUN_AS``), else as this process's user; their HOME in the job's folder."""

    run_as: sandbox.RunAs | None = None
    home: Path | None = None
    cover: dict[Path, list[Path]] = field(default_factory=dict)

    @classmethod
    def of(cls, job_dir: Path, data_uri: str | None = None) -> Jail:
        """``data_uri``: the site's dataset replica; a local one's folder is bound in too."""
        run_as = sandbox.RunAs.parse(os.environ.get(sandbox.ENV_RUN_AS))
        if run_as is None:
            return cls()
        home = sandbox.own(job_dir / "home", run_as, 0o700, user=True)
        sandbox.own(home / "tmp", run_as, 0o700, user=True)
        return cls(run_as, home, sandbox.views(sandbox.needed_paths(job_dir, sandbox.local_data(data_uri))))

    def preexec(self, cwd: Path) -> Any:
        if self.run_as is None:
            return None
        run_as, cover = self.run_as, self.cover
        return lambda: sandbox.enter(run_as, cover, cwd)


def _start(spec: AttemptSpec, run_dir: Path, ckpt: Path, code: Path | None = None,
           tee: bool = False, jail: Jail | None = None) -> list[Worker]:
    """One process per rank of `spec`, with :func:`worker_env`'s environment built on an allow-list of
    this process's (:func:`cpn.runtime.sandbox.worker_base`) and, in a `jail`, as the job's uid; with
    `tee` their output also goes to this process's stdout, prefixed with the rank (a pod's log)."""
    jail = jail or Jail()
    log_dir = sandbox.own(run_dir / f"site-{spec.site_index}", jail.run_as, 0o2750)
    workers = []
    module = "cpn.train.run" if code is not None else "cpn.runtime.train"
    base = sandbox.worker_base(dict(os.environ), jail.home)
    for rank in spec.ranks:
        env = worker_env(spec, rank, run_dir=str(run_dir), checkpoint_dir=str(ckpt), base=base,
                         extra={ENV.CODE_DIR: str(code)} if code is not None else None)
        log_path = log_dir / f"rank{rank}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", module], env=env,
                                    stdout=subprocess.PIPE if tee else log, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=str(run_dir), preexec_fn=jail.preexec(run_dir))
        worker = Worker(rank, proc, log_path)
        if tee:
            assert proc.stdout is not None
            worker.tee = threading.Thread(target=_tee, args=(proc.stdout, log_path, rank_prefix(rank)), daemon=True)
            worker.tee.start()
        workers.append(worker)
    return workers


_STDOUT = threading.Lock()


def _tee(stream: IO[bytes], log_path: Path, prefix: str) -> None:
    with stream, open(log_path, "ab") as log:
        for line in iter(stream.readline, b""):
            log.write(line)
            log.flush()
            with _STDOUT:
                sys.stdout.buffer.write(prefix.encode() + line)
                sys.stdout.buffer.flush()


def _state(workers: list[Worker]) -> tuple[str, str]:
    codes = [w.exit_code for w in workers]
    bad = [w for w in workers if w.exit_code not in (None, 0)]
    if bad:
        first = bad[0]
        why = _last_error(first.log)
        return "Failed", f"rank {first.rank} exited {first.exit_code}" + (f": {why}" if why else "")
    if all(c == 0 for c in codes):
        return "Succeeded", ""
    return "Running", ""


def _write_status(run_dir: Path, status: dict[str, Any]) -> None:
    tmp = run_dir / "status.tmp"
    tmp.write_text(json.dumps({**status, "pid": os.getpid(), "at": time.time()}))
    os.replace(tmp, run_dir / "status.json")


def _kill(workers: list[Worker]) -> None:
    for w in workers:
        if w.exit_code is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGKILL)


def _prepare(spec: AttemptSpec, sync: CheckpointSync) -> tuple[AttemptSpec, str]:
    """Resume only from a checkpoint that exists; otherwise start cleanly and say so."""
    if spec.attempt == 1 and not spec.train.resume:
        return spec, ""
    try:
        step = sync.fetch()
    except httpx.HTTPError as exc:
        step = None
        print(f"checkpoint fetch failed: {exc}", file=sys.stderr, flush=True)
    if step is None:
        train = spec.train.model_copy(update={"resume": None})
        return spec.model_copy(update={"train": train}), "no complete checkpoint exists: starting from step 0"
    sync.prune_after(step)
    train = spec.train.model_copy(update={"resume": str(sync.root)})
    return spec.model_copy(update={"train": train}), f"resuming from the checkpoint of step {step}"


def supervise(spec: AttemptSpec, run_dir: Path, job_dir: Path | None = None, *, tee: bool = False) -> int:
    """Run the sub-task (or a pod's share of it) to its end. Returns the exit code a container
    reports for it: 0 when every worker succeeded, else the first failed worker's (128+N for signal N)."""
    client = _client(spec)
    job_dir = job_dir or run_dir.parent.parent  # local: one folder per job, shared by its attempts
    jail = Jail.of(job_dir, spec.data.uri if spec.data is not None else None)
    ckpt = sandbox.own(job_dir / "checkpoints", jail.run_as, 0o2770)
    sync, keep = CheckpointSync(ckpt, spec, client), checkpoint.keep_from_env()
    spec, note = _prepare(spec, sync)
    sandbox.share_tree(ckpt, jail.run_as, writable=True)
    if note:
        print(note, flush=True)
    code = fetch_code(spec, job_dir, client)
    if code is not None:
        sandbox.own(code.parent, jail.run_as, 0o2750)
        sandbox.share_tree(code, jail.run_as)
    workers = _start(spec, run_dir, ckpt, code, tee=tee, jail=jail)
    relay = Relay(run_dir, spec, client)
    stop: dict[str, str | None] = {"why": None}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(why="Cancelled"))
    deadline = time.monotonic() + TIMEOUT_SECONDS
    runner = "Running"
    while True:
        for w in workers:
            if w.exit_code is None:
                w.exit_code = w.proc.poll()
        phase, message = _state(workers)
        if phase == "Failed":
            _kill(workers)  # a site whose worker died is gone as a whole
        if stop["why"] or time.monotonic() > deadline:
            runner = stop["why"] or "TimedOut"
            _kill(workers)
        relay.collect()
        relay.flush()
        with contextlib.suppress(httpx.HTTPError, OSError):
            sync.push()
        _retain(sync, keep)
        if all(w.exit_code is not None for w in workers):
            break
        _write_status(run_dir, _status(workers, runner, phase, message or note))
        time.sleep(POLL_SECONDS)
    phase, message = _state(workers)  # every worker has exited: final
    lost = _epilogue(workers, relay, sync, run_dir, spec, client, weights=runner == "Running" and phase == "Succeeded")
    _retain(sync, keep)
    # only now does the site see the sub-task's end: its metrics, checkpoints and final weights are in
    # the API before the job can turn Succeeded (a report sent after that is refused) — or it says that
    # they are not, and the driver keeps them on the site's disk
    status = _status(workers, "Finished" if runner == "Running" else runner, phase, message or note)
    if lost:
        status["message"] = "; ".join(x for x in (status["message"], f"outputs not stored on the server: {lost}") if x)
    _write_status(run_dir, {**status, "outputs": "unsaved" if lost else "stored"})
    return exit_code(workers, runner)


def _status(workers: list[Worker], runner: str, phase: str, message: str) -> dict[str, Any]:
    codes = {str(w.rank): w.exit_code for w in workers}
    return {"phase": runner, "message": message,
            "subtask": {"phase": phase, "exitCodes": codes, "pids": [w.proc.pid for w in workers]}}


def outage_window() -> float:
    """Seconds the runner keeps retrying to store a run's outputs while the API, its database or its
    blob store is unavailable (``CPN_OUTAGE_WINDOW_SECONDS``, default :data:`OUTAGE_WINDOW_SECONDS`)."""
    raw = os.environ.get(ENV_OUTAGE_WINDOW)
    try:
        value = float(raw) if raw else OUTAGE_WINDOW_SECONDS
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(f"{ENV_OUTAGE_WINDOW}={raw!r}: write the seconds to keep retrying, e.g. 300")
    return value


def _transient(exc: Exception) -> bool:
    """Worth retrying: the API unreachable, failing (5xx: its database or disk), busy or mid-change."""
    if isinstance(exc, httpx.HTTPStatusError):
        code = exc.response.status_code
        return code >= 500 or code in (408, 429) or _stale(exc.response)
    return isinstance(exc, httpx.HTTPError)


def _why(exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code} {exc.response.text[:200]}".strip()
    return f"{type(exc).__name__}: {exc}"[:300]


@dataclass
class _Upload:
    """One of the epilogue's uploads: done, given up (refused for good), or still to retry."""

    send: Any
    done: bool = False
    refused: str = ""
    error: str = ""

    def attempt(self) -> None:
        if self.done:
            return
        try:
            self.send()
        except (httpx.HTTPError, OSError) as exc:
            self.error = _why(exc)
            if not _transient(exc):
                self.done, self.refused = True, self.error
            return
        self.done, self.error = True, ""


def _epilogue(workers: list[Worker], relay: Relay, sync: CheckpointSync, run_dir: Path, spec: AttemptSpec,
              client: httpx.Client | None, *, weights: bool) -> str:
    """After the workers exit: their last log lines, metrics, checkpoint files and (``weights``: the run
    succeeded) the final weights, retried with backoff through an outage of up to :func:`outage_window`
    seconds. Returns what could not be stored ("" when the server has confirmed everything); the
    files stay on this site's disk either way."""
    for w in workers:
        if w.tee is not None:
            w.tee.join(timeout=5)
    uploads = {"checkpoints": _Upload(sync.push)}
    if weights:
        uploads["final weights"] = _Upload(lambda: push_final(spec, run_dir, client))
    deadline, delay = time.monotonic() + outage_window(), 0.5
    while True:
        relay.collect()
        relay.flush()
        for upload in uploads.values():
            upload.attempt()
        pending = [f"{name} ({u.error})" for name, u in uploads.items() if not u.done]
        pending += [f"{len(relay.pending)} metric report(s)"] if relay.pending else []
        if not pending or time.monotonic() >= deadline:
            break
        print(f"outputs not stored yet, retrying in {delay:.1f}s: {'; '.join(pending)}", file=sys.stderr, flush=True)
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 15.0)
    lost = pending + [f"{name} refused: {u.refused}" for name, u in uploads.items() if u.refused and
                      (name == "final weights" or weights)]
    if lost:
        print(f"outputs NOT stored on the server: {'; '.join(lost)}; they stay in {run_dir}", file=sys.stderr,
              flush=True)
    return "; ".join(lost)


def exit_code(workers: list[Worker], runner: str = "Running") -> int:
    """A container's exit code for these workers, as torchrun would report it."""
    bad = next((w.exit_code for w in workers if w.exit_code not in (None, 0)), None)
    if bad is not None:
        return 128 - bad if bad < 0 else min(bad, 255)
    return 0 if runner == "Running" else 143  # cancelled or timed out before any worker failed


def pod_share(spec: AttemptSpec, index: int, ranks_per_pod: int) -> AttemptSpec:
    """The ranks of pod `index` of a sub-task run as `ranks_per_pod` ranks per pod."""
    if ranks_per_pod < 1 or index < 0 or (index + 1) * ranks_per_pod > spec.workers:
        raise ValueError(f"pod {index} of {ranks_per_pod} ranks is outside sub-task {spec.subtask} "
                         f"({spec.workers} ranks)")
    return AttemptSpec.model_validate({**spec.model_dump(), "first_rank": spec.first_rank + index * ranks_per_pod,
                                       "workers": ranks_per_pod})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cpn.runtime.jobrunner",
                                     description="Run one sub-task of a job attempt at this site.")
    parser.add_argument("run_dir", type=Path, help="where status.json, the rank logs and metrics go")
    parser.add_argument("--contract", type=Path, help="the attempt contract [RUN_DIR/spec.json]")
    parser.add_argument("--job-dir", type=Path, help="checkpoints and code bundles [RUN_DIR/../..]")
    parser.add_argument("--pod-index", type=int, help="in a Kubernetes pod: its completion index")
    parser.add_argument("--ranks-per-pod", type=int, help="with --pod-index: ranks in each pod of the sub-task")
    parser.add_argument("--termination-log", type=Path, help="write the outcome here too (a pod's termination message)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run_dir: Path = args.run_dir
    pod = args.pod_index is not None
    if pod != (args.ranks_per_pod is not None):
        print("--pod-index and --ranks-per-pod go together", file=sys.stderr)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    sandbox.make_undumpable()  # it holds the worker token: not readable through /proc by the workers
    if os.environ.get(sandbox.ENV_RUN_AS):
        os.umask(0o027)  # what it writes the job's group may read (the folders are setgid), nobody else
    try:
        spec = AttemptSpec.model_validate_json((args.contract or run_dir / "spec.json").read_text())
        if pod:
            spec = pod_share(spec, args.pod_index, args.ranks_per_pod)
        _write_status(run_dir, {"phase": "Starting", "subtask": {"phase": "Launching"}})
        code = supervise(spec, run_dir, args.job_dir, tee=pod)
    except Exception as exc:  # noqa: BLE001 - report, never leave the agent guessing
        message = f"{type(exc).__name__}: {exc}"
        _write_status(run_dir, {"phase": "Error", "message": message})
        print(f"job runner: {message}", file=sys.stderr, flush=True)
        _termination(args.termination_log, message)
        return 1
    status = json.loads((run_dir / "status.json").read_text())
    _termination(args.termination_log, status.get("message") or "")
    return code if pod else 0  # the local driver reads status.json; a pod's exit code is its report


def _termination(path: Path | None, message: str) -> None:
    if path is not None and message:
        with contextlib.suppress(OSError):
            path.write_text(message[:4000])


if __name__ == "__main__":
    sys.exit(main())
