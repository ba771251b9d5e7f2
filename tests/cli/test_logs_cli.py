"""`cpnctl logs` against a live server, its lines shipped the way site agents ship them (POST
/api/v1/subtasks/{uid}/logs with the provider's token): --site, --rank, --attempt, --tail, and -f
started before the job's first attempt exists, which streams it and ends by itself when the job ends."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.cli.test_first_hour import demo_world

JOB = {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": "two-sites"},
       "spec": {"model": "tiny", "tokens": 120_000, "globalBatchTokens": 3072, "strategy": "diloco",
                "innerSteps": 10, "gpus": {"min": 2, "max": 2}, "sites": {"min": 2, "max": 2}}}


@pytest.fixture
def shop(live_server):  # type: ignore[no-untyped-def]
    """The demo's three CPU sites, heartbeating; a cpnctl context for alice; the providers' tokens by site."""
    live_server.by_site = demo_world(live_server)
    assert live_server.cpnctl("apply", "-f", "-", input=json.dumps(JOB)).returncode == 0
    return live_server


def _accept_and_wait_for_subtasks(shop) -> list[dict]:  # type: ignore[no-untyped-def]
    out = shop.cpnctl("accept", "two-sites", "--quote", "cheapest")
    assert out.returncode == 0, out.stderr
    for _ in range(100):  # the server's reconciler writes attempt 1 within a pass or two
        items = httpx.get(f"{shop.url}/api/v1/jobs/two-sites/subtasks", timeout=10,
                          headers={"Authorization": f"Bearer {shop.user}"}).json()["items"]
        if items:
            assert len(items) == 2, items
            return sorted(items, key=lambda t: t["spec"]["firstRank"])
        time.sleep(0.2)
    raise AssertionError("no sub-tasks were written for the accepted job")


def _ship(shop, subtask: dict, lines: list[tuple[int, str]]) -> None:  # type: ignore[no-untyped-def]
    resp = httpx.post(f"{shop.url}/api/v1/subtasks/{subtask['metadata']['uid']}/logs", timeout=10,
                      headers={"Authorization": f"Bearer {shop.by_site[subtask['spec']['site']]}"},
                      json={"lines": [{"rank": r, "line": text} for r, text in lines]})
    assert resp.status_code == 200, resp.text


def _logs(shop, *args: str) -> list[str]:  # type: ignore[no-untyped-def]
    out = shop.cpnctl("logs", "two-sites", *args)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_logs_filters(shop) -> None:  # type: ignore[no-untyped-def]
    first, second = _accept_and_wait_for_subtasks(shop)
    a, b = first["spec"]["site"], second["spec"]["site"]
    rank_b = second["spec"]["firstRank"]
    _ship(shop, first, [(0, "alpha one"), (0, "alpha two")])
    _ship(shop, second, [(rank_b, "beta one"), (rank_b, "beta two"), (rank_b, "beta three")])
    everything = [f"[{a} rank0] alpha one", f"[{a} rank0] alpha two", f"[{b} rank{rank_b}] beta one",
                  f"[{b} rank{rank_b}] beta two", f"[{b} rank{rank_b}] beta three"]
    assert _logs(shop) == everything
    assert _logs(shop, "--site", b) == everything[2:]
    assert _logs(shop, "--site", f"{a}-cpu") == everything[:2]  # a cluster's name works too
    assert _logs(shop, "--rank", str(rank_b)) == everything[2:]
    assert _logs(shop, "--attempt", "1", "--tail", "2") == everything[-2:]
    assert _logs(shop, "--tail", "1", "--rank", "0") == everything[1:2]
    out = shop.cpnctl("logs", "two-sites", "--site", "mars-1")
    assert out.returncode == 1 and "mars-1" in out.stderr and a in out.stderr, out.stderr  # names the real sites
    out = shop.cpnctl("logs", "two-sites", "--attempt", "7")
    assert out.returncode == 1 and "no attempt 7" in out.stderr and "-f" in out.stderr, out.stderr


def test_follow_started_before_the_first_attempt_ends_when_the_job_ends(shop, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    exe = Path(__import__("sys").executable).parent / "cpnctl"
    sink = (tmp_path / "follow.out").open("w+")
    follower = subprocess.Popen([str(exe), "logs", "two-sites", "-f", "--rank", "0"], env=shop.env,
                                stdout=sink, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.0)  # the job is Quoted: no attempt yet, the follow waits
        assert follower.poll() is None, Path(sink.name).read_text()
        first, second = _accept_and_wait_for_subtasks(shop)
        _ship(shop, first, [(0, "step 1 loss 5.1")])
        _ship(shop, second, [(second["spec"]["firstRank"], "another rank: filtered out")])
        _ship(shop, first, [(0, "step 2 loss 4.7")])
        for _ in range(100):
            if "step 2" in Path(sink.name).read_text():
                break
            time.sleep(0.1)
        assert follower.poll() is None  # the job runs on: so does the follow
        assert shop.cpnctl("cancel", "two-sites").returncode == 0
        assert follower.wait(timeout=30) == 0  # ends by itself once the job ended and the lines are drained
    finally:
        if follower.poll() is None:
            follower.kill()
    site = first["spec"]["site"]
    assert Path(sink.name).read_text().splitlines() == [  # (stderr too) what a Quoted job waits for, then its lines
        "two-sites is Quoted: no worker runs until a quote is accepted (cpnctl accept two-sites --quote balanced); "
        "following from its first attempt, Ctrl-C to stop",
        "--- attempt 1 ---", f"[{site} rank0] step 1 loss 5.1", f"[{site} rank0] step 2 loss 4.7"]
