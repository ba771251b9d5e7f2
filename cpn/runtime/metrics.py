"""Per-rank training metrics: JSON lines on disk and, optionally, batches POSTed over HTTP.

A report is one flat dict in the wire shape the orchestrator reads (camelCase keys):
``{rank, site, step, tokens, trainLoss, valLoss, tokensPerSecond, computeSeconds, commSeconds,
waitSeconds, intraBytes, wanBytes, gpuSeconds, final, wallSeconds}``. ``gpuSeconds`` is how long
the rank has held its device (one GPU, or one CPU slot on a GPU-less site) since it bound it: what
metering bills and what the compute model predicts (GPUs x wall time). Sinks never raise into the
training loop: a sink that fails logs once and keeps going.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cpn.runtime.config import ENV_METRICS_TOKEN, ENV_METRICS_URL

log = logging.getLogger(__name__)


class MetricsSink(Protocol):
    def emit(self, report: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class FileSink:
    """One JSON line per report, flushed at once: the site's job runner tails these files to relay
    progress to the orchestrator while the run goes on."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")

    def emit(self, report: dict[str, Any]) -> None:
        self._fh.write(json.dumps(report, separators=(",", ":")) + "\n")
        self.flush()

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class HttpSink:
    """POSTs ``{"reports": [...], "batchId": ...}`` with a bearer token every ``batch_size`` reports or
    ``interval`` s. A batch keeps its id and its reports until it is answered, so a batch re-sent after
    a lost answer is one the server recognises and does not store twice."""

    def __init__(self, url: str, token: str | None = None, *, batch_size: int = 20, interval: float = 5.0,
                 timeout: float = 5.0):
        self.url, self.token, self.timeout = url, token, timeout
        self.batch_size, self.interval = batch_size, interval
        self._pending: list[dict[str, Any]] = []
        self._batch: tuple[str, int] | None = None  # the head batch in flight: (id, size), the same on every retry
        self._last = time.monotonic()
        self.failures = 0

    def emit(self, report: dict[str, Any]) -> None:
        self._pending.append(report)
        if report.get("final") or len(self._pending) >= self.batch_size or time.monotonic() - self._last > self.interval:
            self.flush()

    def flush(self) -> None:
        while self._pending and self._send_head():
            pass

    def _send_head(self) -> bool:
        """POST the batch in flight (made of what is pending if none is); whether it was answered."""
        if self._batch is None:
            self._batch = (uuid.uuid4().hex, len(self._pending))
        batch_id, count = self._batch
        body = json.dumps({"reports": self._pending[:count], "batchId": batch_id}).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read()
        except Exception as exc:  # the training must not die because the collector is down
            self.failures += 1
            if self.failures == 1:
                log.warning("metrics POST to %s failed (%s); training continues", self.url, exc)
            if len(self._pending) > 10 * self.batch_size:
                self._pending, self._batch = self._pending[-self.batch_size :], None
            return False
        del self._pending[:count]
        self._batch = None
        self._last = time.monotonic()
        return True

    def close(self) -> None:
        self.flush()


@dataclass
class LogSink:
    """One human line per validation, at most one other every `every` seconds, and the last: what a
    user reads in `cpnctl logs` (stderr, so the summary on stdout stays machine-readable)."""

    def __init__(self, every: float = 10.0, stream: Any = None):
        self.every, self.stream, self.last = every, stream, -every

    def emit(self, report: dict[str, Any]) -> None:
        now = time.monotonic()
        if report.get("valLoss") is None and not report.get("final") and now - self.last < self.every:
            return
        self.last = now
        tokens = report.get("jobTokens") or report["tokens"]  # the job-wide count where the strategy keeps one
        parts = [f"step {report['step']}", f"{tokens:,} tokens"]
        for key, label in (("trainLoss", "train loss"), ("valLoss", "val loss")):
            if report.get(key) is not None:
                parts.append(f"{label} {report[key]:.4f}")
        parts.append(f"{report.get('tokensPerSecond', 0.0):,.0f} tokens/s")
        if report.get("wanBytes"):
            parts.append(f"WAN {report['wanBytes'] / 1e6:,.1f} MB")
        if report.get("final"):
            parts.append("done")
        print(" · ".join(parts), file=self.stream or sys.stderr, flush=True)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class Timers:
    """Where a rank's wall time went: computing, communicating, or waiting for peers."""

    compute: float = 0.0
    comm: float = 0.0
    wait: float = 0.0
    intra_bytes: int = 0
    wan_bytes: int = 0

    def add(self, kind: str, seconds: float) -> None:
        setattr(self, kind, getattr(self, kind) + seconds)

    def timed(self, kind: str) -> _Timed:
        return _Timed(self, kind)


class _Timed:
    def __init__(self, timers: Timers, kind: str):
        self.timers, self.kind = timers, kind

    def __enter__(self) -> _Timed:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timers.add(self.kind, time.perf_counter() - self.t0)


class Recorder:
    """Builds reports for one rank and fans them out to its sinks."""

    def __init__(self, *, rank: int, site: int, sinks: list[MetricsSink], device_since: float | None = None):
        self.rank, self.site, self.sinks = rank, site, sinks
        self.t0 = time.perf_counter()
        self.device_since = self.t0 if device_since is None else device_since
        self.curve: list[dict[str, Any]] = []  # the reports that carry a validation loss

    def report(self, *, step: int, tokens: int, timers: Timers, train_loss: float | None,
               val_loss: float | None = None, final: bool = False, **extra: Any) -> dict[str, Any]:
        now = time.perf_counter()
        wall = now - self.t0
        report = {
            "rank": self.rank, "site": self.site, "step": step, "tokens": tokens,
            "trainLoss": train_loss, "valLoss": val_loss,
            "tokensPerSecond": tokens / wall if wall > 0 else 0.0,
            "computeSeconds": round(timers.compute, 4), "commSeconds": round(timers.comm, 4),
            "waitSeconds": round(timers.wait, 4), "intraBytes": timers.intra_bytes,
            "wanBytes": timers.wan_bytes, "gpuSeconds": round(now - self.device_since, 4), "wallSeconds": round(wall, 4),
            "final": final, **extra,
        }
        if val_loss is not None:
            self.curve.append(report)
        for sink in self.sinks:
            try:
                sink.emit(report)
            except Exception as exc:  # noqa: BLE001 - a sink never stops training
                log.warning("metrics sink %r failed: %s", sink, exc)
        return report

    def flush(self) -> None:
        """Send what the sinks hold; they stay open."""
        self._each("flush")

    def close(self) -> None:
        self._each("close")

    def _each(self, method: str) -> None:
        for sink in self.sinks:
            try:
                getattr(sink, method)()
            except Exception as exc:  # noqa: BLE001 - a sink never stops training
                log.warning("metrics sink %r failed to %s: %s", sink, method, exc)


def default_sinks(rank: int, run_dir: str | Path | None) -> list[MetricsSink]:
    sinks: list[MetricsSink] = []
    if run_dir:
        sinks.append(FileSink(Path(run_dir) / "metrics" / f"rank{rank}.jsonl"))
        sinks.append(LogSink())
    url = os.environ.get(ENV_METRICS_URL)
    if url:
        sinks.append(HttpSink(url, os.environ.get(ENV_METRICS_TOKEN)))
    return sinks


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> Path:
    path = Path(run_dir) / "summary.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, path)
    return path


def gather_finals(store: Any, expected: list[int], others: list[int], timeout: float = 120.0) -> dict[int, dict[str, Any]]:
    """Every rank's final report through the job's store: wait for ``expected``, take ``others`` if there."""
    deadline = time.monotonic() + timeout
    finals: dict[int, dict[str, Any]] = {}
    for rank in expected:
        key = f"cpn/final/{rank}"
        while not store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.02)
    for rank in sorted(set(expected) | set(others)):
        key = f"cpn/final/{rank}"
        if store.check([key]):
            finals[rank] = json.loads(store.get(key))
    return finals


def summarize(finals: dict[int, dict[str, Any]], curve: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    """The run summary: totals over ranks, rank 0's final val loss and validation curve."""
    reports = list(finals.values())
    wall = max((r["wallSeconds"] for r in reports), default=0.0)
    busy = sum(r["wallSeconds"] for r in reports) or 1.0
    compute = sum(r["computeSeconds"] for r in reports)
    comm = sum(r["commSeconds"] for r in reports)
    wait = sum(r["waitSeconds"] for r in reports)
    rank0 = finals.get(0, {})
    return {
        **meta,
        "wall_seconds": round(wall, 3),
        "final_val_loss": rank0.get("valLoss"),
        "initial_val_loss": curve[0]["valLoss"] if curve else None,
        "tokens": sum(r["tokens"] for r in reports),
        "wan_bytes": sum(r["wanBytes"] for r in reports),
        "intra_bytes": sum(r["intraBytes"] for r in reports),
        "compute_seconds": round(compute, 3),
        "comm_seconds": round(comm, 3),
        "wait_seconds": round(wait, 3),
        "gpu_seconds": round(sum(r.get("gpuSeconds", 0.0) for r in reports), 3),
        "compute_utilization": round(compute / busy, 4),
        "comm_fraction": round(comm / busy, 4),
        "finished_ranks": sorted(finals),
        "val_curve": [
            {"wall": r["wallSeconds"], "tokens": r.get("jobTokens", r["tokens"]), "step": r["step"], "val": r["valLoss"]}
            for r in curve if r.get("valLoss") is not None
        ],
    }
