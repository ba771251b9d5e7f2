"""A site agent stopped with SIGTERM (or Ctrl-C) says goodbye (issue 32, item 6): one last heartbeat with
its provider token reports the cluster not Ready with no GPU free, so nothing new is placed there from
that moment, not only once the heartbeat has timed out. Against the real API, in-process."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from datetime import timedelta

import pytest

from cpn.agent.heartbeat import AgentConfig, Registration, goodbye, run_agent_until_stopped


def _url(api) -> str:  # type: ignore[no-untyped-def]
    return str(api.client.make_url("")).rstrip("/")


async def _cluster(api) -> dict:  # type: ignore[no-untyped-def]
    resp = await api.client.get("/api/v1/clusters/lab-cpu", headers=api.auth("prov-a"))
    assert resp.status == 200, await resp.text()
    return await resp.json()


def _config(api, **more: object) -> AgentConfig:  # type: ignore[no-untyped-def]
    return AgentConfig(cluster="lab-cpu", server=_url(api), token=api.tokens["prov-a"], local=True, gpus=2,
                       register=Registration(site="lab-1", region="eu-west", price_per_gpu_hour="0.10"),
                       interval=timedelta(seconds=0.2), work=False, **more)  # type: ignore[arg-type]


async def _until_ready(api) -> dict:  # type: ignore[no-untyped-def]
    for _ in range(200):
        resp = await api.client.get("/api/v1/clusters/lab-cpu", headers=api.auth("prov-a"))
        if resp.status == 200 and (got := await resp.json())["status"]["ready"] == "True":
            return got
        await asyncio.sleep(0.05)
    raise AssertionError("the agent never made its cluster Ready")


async def test_sigterm_makes_the_cluster_not_ready_at_once(api) -> None:  # type: ignore[no-untyped-def]
    agent = asyncio.ensure_future(run_agent_until_stopped(_config(api)))
    try:
        ready = await _until_ready(api)
        assert ready["status"]["allocatable"]["gpus"] == 2
    finally:
        if not agent.done():  # the handler is installed: the signal goes to the agent, not to pytest
            os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(agent, 20) == "SIGTERM"
    got = await _cluster(api)
    assert got["status"]["ready"] == "False", got["status"]
    ready_condition = next(c for c in got["status"]["conditions"] if c["type"] == "Ready")
    # the goodbye, not a timeout (the server's heartbeat timeout is far longer than this test)
    assert ready_condition["reason"] == "AgentStopped" and "SIGTERM" in ready_condition["message"]
    assert got["status"]["allocatable"]["gpus"] == 0
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)  # the handler is gone with the agent


async def test_an_agent_cancelled_from_outside_says_no_goodbye(api) -> None:  # type: ignore[no-untyped-def]
    agent = asyncio.ensure_future(run_agent_until_stopped(_config(api), signals=(signal.SIGUSR1,)))
    await _until_ready(api)
    agent.cancel()
    with pytest.raises(asyncio.CancelledError):
        await agent
    assert (await _cluster(api))["status"]["ready"] == "True"


async def test_a_goodbye_to_an_unreachable_server_gives_up_quickly(api) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    cfg = AgentConfig(cluster="lab-cpu", server="http://127.0.0.1:1", token=api.tokens["prov-a"], local=True)
    assert await goodbye(cfg, "stopping") is False
    assert time.monotonic() - start < 10


@pytest.mark.slow
def test_cpn_agent_stopped_with_sigterm_exits_0_and_its_cluster_is_not_ready(live_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The command's wiring: a real `cpn agent` process, a real SIGTERM."""
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    token = live_server.token("prov-a", "provider")
    exe = Path(sys.executable).parent / "cpn"
    agent = subprocess.Popen([str(exe), "agent", "--cluster", "lab-cpu", "--local", "--gpus", "2", "--register",
                              "--site", "lab-1", "--region", "eu-west", "--price", "0.10", "--interval", "0.5",
                              "--no-work", "--server", live_server.url],
                             env={**live_server.env, "CPN_TOKEN": token}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    headers = {"Authorization": f"Bearer {token}"}
    try:
        for _ in range(300):
            resp = httpx.get(f"{live_server.url}/api/v1/clusters/lab-cpu", headers=headers, timeout=10)
            if resp.status_code == 200 and resp.json()["status"]["ready"] == "True":
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the agent never made its cluster Ready")
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=60)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, out
    assert "goodbye delivered" in out, out
    status = httpx.get(f"{live_server.url}/api/v1/clusters/lab-cpu", headers=headers, timeout=10).json()["status"]
    assert status["ready"] == "False" and status["allocatable"]["gpus"] == 0, status
