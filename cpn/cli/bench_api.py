"""`cpn bench quotes`: many concurrent quote requests against a real server and database.

Starts `cpn serve` on the given database (PostgreSQL by default), registers a generated catalogue,
then submits N TrainingJobs at once — each submission plans the job and prices three quotes — and
reads their quotes back. Prints JSON and writes docs/benchmarks/quotes.{json,md}.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import httpx

from cpn.runtime.launcher import free_port

DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
SCRATCH_DB = "postgresql+asyncpg://postgres@127.0.0.1:5432/cpn_bench"  # emptied (and created) by every run


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _token(env: dict[str, str], name: str, role: str) -> str:
    out = subprocess.run([sys.executable, "-m", "cpn.cli.server", "token", "create", name, "--role", role], env=env,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


async def _fire(url: str, tokens: list[str], n: int, concurrency: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        async def one(i: int) -> tuple[int, float, int]:
            try:
                return await attempt(i)
            except httpx.HTTPError:
                return 599, 0.0, 0

        async def attempt(i: int) -> tuple[int, float, int]:
            headers = {"Authorization": f"Bearer {tokens[i % len(tokens)]}", "Idempotency-Key": f"bench-{i}"}
            job = {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": f"bench-{i}"},
                   "spec": {"model": "llama-7b", "tokens": 20_000_000_000, "globalBatchTokens": 4_194_304,
                            "gpus": {"min": 8, "max": 64}, "sites": {"min": 1, "max": 3}}}
            t0 = time.perf_counter()
            resp = await client.post("/api/v1/jobs", json=job, headers=headers)
            quotes = await client.get(f"/api/v1/jobs/bench-{i}/quotes", headers=headers) if resp.status_code < 300 \
                else resp
            return resp.status_code, time.perf_counter() - t0, len(quotes.json().get("items", []))

        t0 = time.perf_counter()
        results = await asyncio.gather(*[one(i) for i in range(n)])
        wall = time.perf_counter() - t0
    codes = [r[0] for r in results]
    lat = [r[1] * 1000 for r in results]
    return {"requests": n, "concurrency": concurrency, "wall_seconds": round(wall, 2),
            "errors": sum(1 for c in codes if c >= 300), "status_codes": sorted(set(codes)),
            "quotes_per_job": statistics.mean(r[2] for r in results),
            "latency_ms": {"p50": round(_pct(lat, 0.5), 1), "p95": round(_pct(lat, 0.95), 1),
                           "p99": round(_pct(lat, 0.99), 1)},
            "throughput_rps": round(n / wall, 1)}


@click.command("quotes")
@click.option("--requests", "n", type=int, default=1000, show_default=True)
@click.option("--concurrency", type=int, default=1000, show_default=True)
@click.option("--database-url", default=SCRATCH_DB, show_default=True,
              help="A database the benchmark may fill (use a scratch one).")
@click.option("--clusters", type=int, default=30, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_quotes_cmd(n: int, concurrency: int, database_url: str, clusters: int, as_json: bool) -> None:
    """Submit N jobs concurrently (each planned and quoted) and count errors and latency."""
    from layers.resource.catalog import generate_world

    data = Path(tempfile.mkdtemp(prefix="cpn-bench-quotes-"))
    port = free_port()
    env = {**os.environ, "CPN_DATABASE_URL": database_url, "CPN_DATA_DIR": str(data), "CPN_PORT": str(port),
           "CPN_RECONCILE": "0", "CPN_HEARTBEAT_TIMEOUT_SECONDS": "86400", "CPN_RATE_LIMIT_PER_MINUTE": str(max(6000, 10 * n)), "CPN_LOG_LEVEL": "WARNING"}
    _reset(database_url)
    server = subprocess.Popen([sys.executable, "-m", "cpn.cli.server", "serve"], env=env,
                              stdout=open(data / "server.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, server)
        provider = _token(env, "bench-provider", "provider")
        users = [_token(env, f"bench-user-{i}", "user") for i in range(4)]
        docs = generate_world(sites=max(3, clusters // 3), clusters=clusters, seed=1)
        httpx.post(f"{url}/api/v1/apply", json={"items": docs}, timeout=120,
                   headers={"Authorization": f"Bearer {provider}"}).raise_for_status()
        for d in docs:
            if d["kind"] == "Cluster":
                gpus = sum(p["gpusPerNode"] * p["nodes"] for p in d["spec"]["nodePools"])
                httpx.post(f"{url}/api/v1/clusters/{d['metadata']['name']}/heartbeat", timeout=30,
                           json={"allocatableGpus": gpus}, headers={"Authorization": f"Bearer {provider}"})
        result = asyncio.run(_fire(url, users, n, concurrency))
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    backend = "PostgreSQL" if database_url.startswith("postgresql") else "SQLite"
    result.update(backend=backend, clusters=clusters)
    command = f"cpn bench quotes --requests {n} --concurrency {concurrency} --clusters {clusters}"
    DOCS.mkdir(parents=True, exist_ok=True)
    (DOCS / "quotes.json").write_text(json.dumps({"command": command, **result}, indent=2))
    (DOCS / "quotes.md").write_text(
        f"# Concurrent quote requests\n\n`{command}` ({backend}, {clusters} clusters; each request submits a "
        "TrainingJob, which plans it and prices three quotes, then reads the quotes)\n\n"
        "| requests | concurrency | errors | wall s | req/s | p50 ms | p95 ms | p99 ms |\n|---|---|---|---|---|---|---|---|\n"
        f"| {n} | {concurrency} | {result['errors']} | {result['wall_seconds']} | {result['throughput_rps']} | "
        f"{result['latency_ms']['p50']} | {result['latency_ms']['p95']} | {result['latency_ms']['p99']} |\n")
    click.echo(json.dumps(result, indent=2) if as_json else
               f"{n} requests, {result['errors']} errors, p95 {result['latency_ms']['p95']} ms")


def _reset(url: str) -> None:
    """Empty the benchmark's database (creating it first if the server has none of that name)."""
    if url.startswith("sqlite"):
        return
    from cpn.core import migrate

    asyncio.run(_ensure_database(url))
    migrate.downgrade(url, "base")


async def _ensure_database(url: str) -> None:
    from sqlalchemy import text
    from sqlalchemy.engine import make_url
    from sqlalchemy.ext.asyncio import create_async_engine

    target = make_url(url)
    engine = create_async_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            exists = await conn.scalar(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": target.database})
            if not exists:
                await conn.execute(text(f'CREATE DATABASE "{target.database}"'))
    finally:
        await engine.dispose()



def _wait(url: str, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise click.ClickException("the server exited; see its log")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise click.ClickException("the server did not become healthy")
