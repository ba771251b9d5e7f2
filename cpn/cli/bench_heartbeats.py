"""`cpn bench api`: the API under the load of many clusters' agents and many concurrent quotes.

Starts `cpn serve` on a scratch database (PostgreSQL by default), registers N clusters, then
1. heartbeats one cluster per request (`POST /api/v1/clusters/{name}/heartbeat`) from C concurrent
   clients for S seconds,
2. the same clusters in batches (`POST /api/v1/heartbeats`, B clusters per request, one transaction),
3. (optionally) Q concurrent job submissions, each planned and priced, on a Q-cluster catalogue —
and reports cluster updates per second and request latency percentiles for each, side by side in
one run. The clients run in this process on the same machine as the server, so the figures are a
floor for what the server alone could do. Prints JSON; writes docs/benchmarks/api.{json,md}.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import click
import httpx
from sqlalchemy.engine import make_url

from cpn.api.workers import worker_pids
from cpn.cli.bench_api import DOCS, SCRATCH_DB, _pct, _reset, _token, _wait
from cpn.runtime.launcher import free_port

READY = [{"type": "Ready", "status": "True"}]
REGISTER_CHUNK = 500  # clusters per apply request while registering


@contextmanager
def _server(database_url: str, src: Path | None = None) -> Iterator[tuple[str, dict[str, str], int]]:
    """`cpn serve` on an emptied database; from another checkout `src` (a baseline) when given."""
    data = Path(tempfile.mkdtemp(prefix="cpn-bench-api-"))
    port = free_port()
    env = {**os.environ, "CPN_DATABASE_URL": database_url, "CPN_DATA_DIR": str(data), "CPN_PORT": str(port),
           "CPN_RECONCILE": "0", "CPN_HEARTBEAT_TIMEOUT_SECONDS": "86400",
           "CPN_RATE_LIMIT_PER_MINUTE": "100000000", "CPN_LOG_LEVEL": "WARNING",
           **({"PYTHONPATH": str(src)} if src else {})}
    _reset(database_url)
    server = subprocess.Popen([sys.executable, "-m", "cpn.cli.server", "serve"], env=env, cwd=src,
                              stdout=open(data / "server.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, server)
        yield url, env, server.pid
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds the server has used (user + system), from /proc: its process and the worker processes
    it forked (``cpn serve --workers``); None where there is none. On a shared machine this, per request,
    is steadier than wall time."""
    total = None
    for proc in [pid, *worker_pids(pid)]:
        try:
            fields = Path(f"/proc/{proc}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total = (total or 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _measured(pid: int, run: Any) -> dict[str, Any]:
    """Run one phase and add the server's CPU milliseconds per request during it."""
    before = _cpu_seconds(pid)
    result = asyncio.run(run)
    after = _cpu_seconds(pid)
    if before is not None and after is not None and result["requests"]:
        result["server_cpu_ms_per_request"] = round((after - before) * 1000 / result["requests"], 1)
    result["server_workers"] = max(1, len(worker_pids(pid)))
    return result


def _register(url: str, token: str, clusters: int) -> list[tuple[str, int]]:
    """A generated catalogue of `clusters` clusters; returns (name, GPUs) of each."""
    from layers.resource.catalog import generate_world

    docs = generate_world(sites=max(3, clusters // 20), clusters=clusters, seed=1, links=0)
    headers = {"Authorization": f"Bearer {token}"}
    for start in range(0, len(docs), REGISTER_CHUNK):
        httpx.post(f"{url}/api/v1/apply", json={"items": docs[start:start + REGISTER_CHUNK]}, timeout=600,
                   headers=headers).raise_for_status()
    return [(d["metadata"]["name"], sum(p["gpusPerNode"] * p["nodes"] for p in d["spec"]["nodePools"]))
            for d in docs if d["kind"] == "Cluster"]


async def _load(url: str, token: str, streams: list[Iterator[tuple[str, Any]]], seconds: float,
                interval: float | None = None) -> dict[str, Any]:
    """One client per stream posts its (path, body) pairs for `seconds`; latency per request, clusters
    per second. Each client reports its own clusters, as each site's agent does. Without `interval`
    the clients send back to back (throughput); with it each sends one request per `interval` s
    (latency at a given load, as agents on a heartbeat period do)."""
    concurrency = len(streams)
    latencies: list[float] = []
    updates = 0
    errors: dict[str, int] = {}
    deadline = time.perf_counter() + seconds
    headers = {"Authorization": f"Bearer {token}"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(url, headers=headers, connector=connector) as session:
        async def client(k: int, bodies: Iterator[tuple[str, Any]]) -> None:
            due = time.perf_counter() + (interval or 0) * k / concurrency  # spread the clients over a period
            while time.perf_counter() < deadline:
                if interval:
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    due += interval
                path, body = next(bodies)
                t0 = time.perf_counter()
                try:
                    async with session.post(path, json=body) as resp:
                        await resp.read()
                        status = resp.status
                except aiohttp.ClientError as exc:
                    status = type(exc).__name__
                latencies.append((time.perf_counter() - t0) * 1000)
                if status != 200:
                    errors[str(status)] = errors.get(str(status), 0) + 1
                else:
                    nonlocal updates
                    updates += len(body["items"]) if "items" in body else 1

        t0 = time.perf_counter()
        await asyncio.gather(*[client(k, stream) for k, stream in enumerate(streams)])
        wall = time.perf_counter() - t0
    return {"requests": len(latencies), "errors": errors, "wall_seconds": round(wall, 2),
            "requests_per_second": round(len(latencies) / wall, 1),
            "cluster_updates_per_second": round(updates / wall, 1),
            "latency_ms": {q: round(_pct(latencies, v), 1) for q, v in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))}}


QUOTE_JOB = {"model": "llama-7b", "tokens": 20_000_000_000, "globalBatchTokens": 4_194_304,
             "gpus": {"min": 8, "max": 64}, "sites": {"min": 1, "max": 3}}  # as `cpn bench quotes` submits


async def _quote_burst(url: str, tokens: list[str], n: int) -> dict[str, Any]:
    """n job submissions at once (each planned and priced into three quotes), each followed by reading
    its quotes; latency is submission + read. An aiohttp client, lighter than httpx, so that less of
    the shared machine goes to the clients."""
    connector = aiohttp.TCPConnector(limit=n)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:
        async def one(i: int) -> tuple[int | str, float, int]:
            headers = {"Authorization": f"Bearer {tokens[i % len(tokens)]}", "Idempotency-Key": f"bench-{i}"}
            job = {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": f"bench-{i}"}, "spec": QUOTE_JOB}
            t0 = time.perf_counter()
            try:
                async with session.post("/api/v1/jobs", json=job, headers=headers) as resp:
                    await resp.read()
                    status: int | str = resp.status
                if status != 201:
                    return status, time.perf_counter() - t0, 0
                async with session.get(f"/api/v1/jobs/bench-{i}/quotes", headers=headers) as resp:
                    items = (await resp.json()).get("items", []) if resp.status == 200 else []
                    status = 201 if resp.status == 200 else resp.status
            except aiohttp.ClientError as exc:
                status = type(exc).__name__
            return status, time.perf_counter() - t0, len(items)

        t0 = time.perf_counter()
        results = await asyncio.gather(*[one(i) for i in range(n)])
        wall = time.perf_counter() - t0
    latencies = [r[1] * 1000 for r in results]
    return {"requests": n, "concurrency": n, "wall_seconds": round(wall, 2),
            "errors": sum(1 for r in results if r[0] != 201), "status_codes": sorted({r[0] for r in results}, key=str),
            "quotes_per_job": round(sum(r[2] for r in results) / n, 2),
            "latency_ms": {q: round(_pct(latencies, v), 1) for q, v in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))},
            "throughput_rps": round(n / wall, 1)}


def _singles(clusters: list[tuple[str, int]]) -> Iterator[tuple[str, Any]]:
    i = 0
    while True:
        name, gpus = clusters[i % len(clusters)]
        i += 1
        yield f"/api/v1/clusters/{name}/heartbeat", {"allocatableGpus": i % (gpus + 1), "conditions": READY}


def _batches(clusters: list[tuple[str, int]], size: int) -> Iterator[tuple[str, Any]]:
    i, size = 0, min(size, len(clusters))  # a client's own clusters, each at most once per request
    while True:
        chunk = [clusters[(i + k) % len(clusters)] for k in range(size)]
        i += size
        yield "/api/v1/heartbeats", {"items": [{"cluster": n, "allocatableGpus": i % (g + 1), "conditions": READY}
                                               for n, g in chunk]}


def _table(result: dict[str, Any]) -> str:
    rows = ["| phase | requests | errors | cluster updates/s | req/s | p50 ms | p95 ms | p99 ms | server CPU ms/req |",
            "|---|---|---|---|---|---|---|---|---|"]
    for phase in ("heartbeat", "heartbeats_batched", "heartbeats_batched_at_rate",
                  "heartbeats_batched_at_rate_baseline"):
        r = result.get(phase)
        if r is None:
            continue
        label = f"{phase.removesuffix('_baseline')}, baseline {r['commit']}" if "commit" in r else phase
        rows.append(f"| {label} | {r['requests']} | {sum(r['errors'].values())} | {r['cluster_updates_per_second']} | "
                    f"{r['requests_per_second']} | {r['latency_ms']['p50']} | {r['latency_ms']['p95']} | "
                    f"{r['latency_ms']['p99']} | {r.get('server_cpu_ms_per_request', '-')} |")
    for key, label in (("quotes", "quotes"), ("quotes_baseline", "quotes, baseline")):
        q = result.get(key)
        if q:
            which = f", {q['commit']}" if "commit" in q else ""
            rows.append(f"| {label} ({q['clusters']} clusters{which}) | {q['requests']} | {q['errors']} | - | "
                        f"{q['throughput_rps']} | {q['latency_ms']['p50']} | {q['latency_ms']['p95']} | "
                        f"{q['latency_ms']['p99']} | {q.get('server_cpu_ms_per_request', '-')} |")
    return "\n".join(rows) + "\n"


@click.command("api")
@click.option("--clusters", type=click.IntRange(min=1), default=10_000, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), default=32, show_default=True,
              help="Concurrent heartbeat clients.")
@click.option("--seconds", type=click.FloatRange(min=0), default=20, show_default=True,
              help="Per heartbeat phase; 0: no heartbeat phases (the quote burst only).")
@click.option("--batch", type=click.IntRange(min=1, max=1000), default=100, show_default=True,
              help="Clusters per batched heartbeat request.")
@click.option("--rate", type=click.FloatRange(min=1), default=1000, show_default=True,
              help="Cluster updates/s offered in the paced batched phase (latency at that load).")
@click.option("--quotes", type=click.IntRange(min=0), default=200, show_default=True,
              help="Concurrent job submissions after the heartbeats (0: none).")
@click.option("--quote-clusters", type=click.IntRange(min=1), default=200, show_default=True,
              help="Catalogue size for the quote phase.")
@click.option("--database-url", default=SCRATCH_DB, show_default=True,
              help="A database the benchmark may empty and fill (use a scratch one).")
@click.option("--baseline", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Another checkout of CPN (e.g. `git worktree add /tmp/base <commit>`): the quote burst is "
                   "run on its server too, right after, on the database <name>_baseline, for a before/after "
                   "in one run.")
@click.option("--baseline-first", is_flag=True,
              help="Run the baseline's quote burst before this checkout's (on a shared machine the order matters).")
@click.option("--json", "as_json", is_flag=True)
@click.option("--write-docs/--no-write-docs", default=True, show_default=True,
              help="Write docs/benchmarks/api.{json,md}.")
def bench_api_cmd(clusters: int, concurrency: int, seconds: float, batch: int, rate: float, quotes: int,
                  quote_clusters: int, database_url: str, baseline: Path | None, baseline_first: bool,
                  as_json: bool, write_docs: bool) -> None:
    """Heartbeats from N clusters (one per request, then batched) and concurrent quotes, side by side."""
    result: dict[str, Any] = {"clusters": clusters, "concurrency": concurrency, "batch": batch,
                              "backend": "PostgreSQL" if database_url.startswith("postgresql") else "SQLite"}
    if 0 < seconds < 1:
        raise click.BadParameter("a heartbeat phase runs for at least 1 s (0: none)", param_hint="--seconds")
    if not seconds and write_docs:
        raise click.UsageError("--seconds 0 measures the quote burst only, which api.md's figures do not hold "
                               "alone: add --no-write-docs")
    if seconds:
        _heartbeat_phases(result, database_url, clusters, concurrency, seconds, batch, rate, baseline)
    if quotes:  # the same burst on the baseline's server, right after (or before), on its own database
        runs = [("quotes", None), *([("quotes_baseline", baseline)] if baseline is not None else [])]
        for key, src in reversed(runs) if baseline_first else runs:
            result[key] = _quote_phase(_baseline_db(database_url) if src else database_url, src, quotes,
                                       quote_clusters)
            if src is not None:
                result[key]["commit"] = _commit_of(src)
    command = (f"cpn bench api --clusters {clusters} --concurrency {concurrency} --seconds {seconds:g} "
               f"--batch {batch} --rate {rate:g} --quotes {quotes} --quote-clusters {quote_clusters}"
               + (f" --baseline {baseline}" if baseline is not None else "")
               + (" --baseline-first" if baseline_first else ""))
    if write_docs:
        _write_docs(command, result, batch)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(_table(result))


def _heartbeat_phases(result: dict[str, Any], database_url: str, clusters: int, concurrency: int, seconds: float,
                      batch: int, rate: float, baseline: Path | None) -> None:
    """The heartbeat phases (one cluster per request, batched, batched at `rate`) into `result`, and the
    paced one again on the baseline's server."""
    with _server(database_url) as (url, env, pid):
        provider = _token(env, "bench-provider", "provider")
        t0 = time.perf_counter()
        catalogue = _register(url, provider, clusters)
        result["register_seconds"] = round(time.perf_counter() - t0, 1)
        click.echo(f"registered {len(catalogue)} clusters in {result['register_seconds']} s", err=True)
        shares = [catalogue[i::concurrency] for i in range(concurrency) if catalogue[i::concurrency]]
        result["heartbeat"] = _measured(pid, _load(url, provider, [_singles(c) for c in shares], seconds))
        click.echo(f"heartbeats: {result['heartbeat']['cluster_updates_per_second']}/s", err=True)
        result["heartbeats_batched"] = _measured(pid, _load(url, provider, [_batches(c, batch) for c in shares],
                                                            seconds))
        click.echo(f"batched: {result['heartbeats_batched']['cluster_updates_per_second']}/s", err=True)
        per_request = min(batch, len(shares[0]))
        interval = len(shares) * per_request / rate  # every client's period, for `rate` updates/s in all
        result["heartbeats_batched_at_rate"] = {
            **_measured(pid, _load(url, provider, [_batches(c, batch) for c in shares], seconds, interval)),
            "target_updates_per_second": rate}
    if baseline is not None:  # the paced phase again on the baseline's server, with the same catalogue
        with _server(_baseline_db(database_url), baseline) as (url, env, pid):
            provider = _token_at(env, baseline, "bench-provider", "provider")
            catalogue = _register(url, provider, clusters)
            shares = [catalogue[i::concurrency] for i in range(concurrency) if catalogue[i::concurrency]]
            result["heartbeats_batched_at_rate_baseline"] = {
                **_measured(pid, _load(url, provider, [_batches(c, batch) for c in shares], seconds, interval)),
                "target_updates_per_second": rate, "commit": _commit_of(baseline)}


def _quote_phase(database_url: str, src: Path | None, quotes: int, quote_clusters: int) -> dict[str, Any]:
    with _server(database_url, src) as (url, env, pid):
        provider = _token_at(env, src, "bench-provider", "provider")
        for name, gpus in _register(url, provider, quote_clusters):
            httpx.post(f"{url}/api/v1/clusters/{name}/heartbeat", timeout=30, json={"allocatableGpus": gpus,
                       "conditions": READY}, headers={"Authorization": f"Bearer {provider}"}).raise_for_status()
        users = [_token_at(env, src, f"bench-user-{i}", "user") for i in range(4)]
        return {**_measured(pid, _quote_burst(url, users, quotes)), "clusters": quote_clusters}


def _token_at(env: dict[str, str], src: Path | None, name: str, role: str) -> str:
    if src is None:
        return _token(env, name, role)
    out = subprocess.run([sys.executable, "-m", "cpn.cli.server", "token", "create", name, "--role", role], env=env,
                         cwd=src, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _baseline_db(database_url: str) -> str:
    if database_url.startswith("sqlite"):
        return database_url.replace(".db", "-baseline.db") if database_url.endswith(".db") else database_url + "-baseline"
    url = make_url(database_url)
    return url.set(database=f"{url.database}_baseline").render_as_string(hide_password=False)


def _commit_of(src: Path) -> str:
    out = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


KEPT_FROM = "\n## "  # api.md's own sections after the figures (the profile) survive a new run


def _write_docs(command: str, result: dict[str, Any], batch: int) -> None:
    DOCS.mkdir(parents=True, exist_ok=True)
    (DOCS / "api.json").write_text(json.dumps({"command": command, **result}, indent=2))
    old = (DOCS / "api.md").read_text() if (DOCS / "api.md").exists() else ""
    kept = old[old.index(KEPT_FROM):] if KEPT_FROM in old else ""
    (DOCS / "api.md").write_text(_figures(command, result, batch) + kept)


def _figures(command: str, result: dict[str, Any], batch: int) -> str:
    return (
        f"# The API under load\n\n`{command}` ({result['backend']}; the clients run on the same machine as the "
        "server; `heartbeat` is one cluster per request, `heartbeats_batched` is `POST /api/v1/heartbeats` "
        f"with {batch} clusters per request and one transaction, each client sending back to back; "
        f"`heartbeats_batched_at_rate` paces the same clients to {result['heartbeats_batched_at_rate']['target_updates_per_second']:g} "
        "cluster updates/s in all, as agents on a heartbeat period would, and shows the latency at that load)\n\n"
        + _table(result))
