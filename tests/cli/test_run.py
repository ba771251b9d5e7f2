"""`cpnctl run -f job.yaml [--quote L] [--max-price X] [--follow]` (issue 32, item 5) against the in-process
API: submit, accept the named quote within the cap or refuse in one line, and with --follow the progress
and the workers' logs until the end, the exit code saying how it ended. The sites are the agent's work loop
over a stand-in driver (tests/agent/test_work.py), driven by the test beside the running command."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from layers.orchestration.lifecycle import logs as logs_module
from layers.resource.drivers.base import LogLine
from tests.agent.test_work import Site, _agents, _pass
from tests.cli.inproc import cpnctl
from tests.layers.orchestration.test_reconciler import _job, _reconciler, _world


def _manifest(tmp_path: Path, name: str, **spec: object) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(_job(name, **spec)))
    return str(path)


async def _get(api, path: str) -> Any:  # type: ignore[no-untyped-def]
    resp = await api.client.get(path, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_run_accepts_the_named_quote_within_the_cap(api, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    out = await cpnctl(api, "alice", "run", "-f", _manifest(tmp_path, "lm"), "--quote", "fastest",
                       "--max-price", "1000")
    assert out.code == 0, out.stderr
    assert out.stdout.splitlines()[0] == "trainingjob/lm created"
    assert "trainingjob/lm accepted (fastest): Reserved" in out.stdout
    assert "cpnctl logs lm -f" in out.stderr  # without --follow: how to follow it
    job = await _get(api, "/api/v1/jobs/lm")
    quotes = (await _get(api, "/api/v1/jobs/lm/quotes"))["items"]
    accepted = [q for q in quotes if q["state"] == "accepted"]
    assert job["status"]["phase"] == "Reserved" and [q["label"] for q in accepted] == ["fastest"]

    again = await cpnctl(api, "alice", "run", "-f", _manifest(tmp_path, "lm"))  # the same file once more
    assert again.code == 0, again.stderr
    assert "trainingjob/lm unchanged" in again.stdout and "accepted before and is Reserved" in again.stderr
    assert "accepted (" not in again.stdout


async def test_run_defaults_to_balanced(api, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    out = await cpnctl(api, "alice", "run", "-f", _manifest(tmp_path, "lm"))
    assert out.code == 0, out.stderr
    assert "accepted (balanced)" in out.stdout
    quotes = (await _get(api, "/api/v1/jobs/lm/quotes"))["items"]
    assert [q["label"] for q in quotes if q["state"] == "accepted"] == ["balanced"]


async def test_run_over_the_cap_is_refused_in_one_line_and_the_job_stays_quoted(api, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    source = _manifest(tmp_path, "big", tokens=30_000_000, gpus={"min": 1, "max": 2}, sites={"min": 1, "max": 2},
                       maxPricePerGpuHour="100")
    dry = await cpnctl(api, "alice", "apply", "-f", source, "--dry-run", "server", "-o", "json")
    assert dry.code == 0, dry.stderr
    prices = {q["label"]: Decimal(q["price"]["total"]) for q in json.loads(dry.stdout)["items"][0]["quotes"]}
    cheapest, fastest = prices["cheapest"], prices["fastest"]
    assert Decimal("0.01") < cheapest < fastest, prices  # the world prices these two apart
    cap = (cheapest + fastest) / 2

    out = await cpnctl(api, "alice", "run", "-f", source, "--quote", "fastest", "--max-price", str(cap))
    assert out.code == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert f"costs {fastest} USD, above --max-price {cap} USD" in lines[0]
    assert f"the cheapest quote costs {cheapest} USD: --quote cheapest" in lines[0]  # what fits instead
    assert "accepted" not in out.stdout
    assert (await _get(api, "/api/v1/jobs/big"))["status"]["phase"] == "Quoted"

    low = await cpnctl(api, "alice", "run", "-f", source, "--quote", "cheapest", "--max-price", "0.001")
    assert low.code == 1 and "raise --max-price" in low.stderr and f"costs {cheapest} USD" in low.stderr
    bad = await cpnctl(api, "alice", "run", "-f", source, "--max-price", "lots")
    assert bad.code == 1 and "--max-price 'lots'" in bad.stderr
    ok = await cpnctl(api, "alice", "run", "-f", source, "--quote", "cheapest", "--max-price", str(cap))
    assert ok.code == 0 and "trainingjob/big configured" in ok.stdout and "accepted (cheapest)" in ok.stdout, ok


async def test_run_takes_one_job(api, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    two = tmp_path / "two.json"
    two.write_text(json.dumps([_job("a"), _job("b")]))
    out = await cpnctl(api, "alice", "run", "-f", str(two))
    assert out.code == 1 and "takes one TrainingJob, found 2" in out.stderr
    assert (await api.client.get("/api/v1/jobs/a", headers=api.auth("alice"))).status == 404  # nothing applied


class TalkingSite(Site):
    """The stand-in site, whose rank 0 prints a line once it runs."""

    async def logs(self, spec, handle, cursor):  # type: ignore[no-untyped-def]
        if cursor.get("said"):
            return [], cursor
        return [LogLine(rank=spec.first_rank, line=f"hello from {spec.subtask}")], {"said": True}


async def _follow(api, db, args: list[str], site: Site) -> Any:  # type: ignore[no-untyped-def]
    """cpnctl run … --follow in a thread while the reconciler and the three sites' agents take turns."""
    command = asyncio.ensure_future(cpnctl(api, "alice", *args, "--follow", "--interval", "0.2"))
    agents, reconciler = _agents(api, site), _reconciler(db, 3600)
    try:
        for _ in range(300):
            if command.done():
                break
            await _pass(reconciler, agents)
            await asyncio.sleep(0.1)
        return await asyncio.wait_for(command, 60)
    finally:
        for agent in agents:
            agent.close()


async def test_run_follow_shows_progress_and_logs_and_exits_0_on_success(api, db, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs_module, "DRAIN_GRACE", timedelta(seconds=0.3))
    await _world(api)
    out = await _follow(api, db, ["run", "-f", _manifest(tmp_path, "lm"), "--quote", "cheapest"], TalkingSite())
    assert out.code == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["trainingjob/lm created", lines[1]] and lines[1].startswith("trainingjob/lm accepted (cheapest)")
    assert any(line.endswith("hello from alice/lm-" + line.split("alice/lm-")[-1]) and "rank0]" in line
               for line in lines), lines  # the worker's own line, as `logs -f` shows it
    assert lines[-1].startswith("trainingjob/lm Succeeded")
    assert "lm: Succeeded" in out.stderr, out.stderr  # progress on stderr, the final phase among it
    assert (await _get(api, "/api/v1/jobs/lm"))["status"]["phase"] == "Succeeded"
    again = await cpnctl(api, "alice", "run", "-f", _manifest(tmp_path, "lm"), "--quote", "cheapest", "--follow")
    assert again.code == 1 and "lm already ended Succeeded, nothing new was run" in again.stderr, again


async def test_run_follow_exits_1_when_the_job_fails(api, db, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs_module, "DRAIN_GRACE", timedelta(seconds=0.3))
    await _world(api)
    out = await _follow(api, db, ["run", "-f", _manifest(tmp_path, "refused")], Site(refuse="refused"))
    assert out.code == 1
    assert "trainingjob/refused Failed" in out.stdout and "quota exceeded" in out.stdout, out.stdout
    assert out.stderr.strip().splitlines()[-1] == "error: refused ended Failed"
