"""The agent against the real API (in-process) and the stub Kubernetes API, through real HTTP."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest
from aiohttp import web
from click.testing import CliRunner
from sqlalchemy import select

from cpn.agent.heartbeat import AgentConfig, Registration, run_agent
from cpn.cli.agent import agent_cmd
from cpn.client import ApiError
from cpn.core.errors import InvalidInput, Unavailable
from layers.resource.models import ClusterRow
from layers.resource.schemas import HeartbeatRequest
from tests.kube_stub import KubeStub, make_node, make_pod

SITE = {"apiVersion": "cpn/v1", "kind": "Site", "metadata": {"name": "fra-1"}, "spec": {"region": "eu-central"}}
K8S_CLUSTER = {"apiVersion": "cpn/v1", "kind": "Cluster", "metadata": {"name": "fra-k8s"}, "spec": {
    "site": "fra-1", "driver": "kubernetes", "kubernetes": {"server": "https://k8s.fra-1.example", "namespace": "cpn"},
    "nodePools": [{"name": "h100", "gpu": {"model": "H100", "memoryGB": 80, "tflops": 989}, "gpusPerNode": 8,
                   "nodes": 2, "pricePerGpuHour": "2.4500"}]}}


def _url(api) -> str:  # type: ignore[no-untyped-def]
    return str(api.client.make_url("")).rstrip("/")


async def _get(api, path: str) -> dict:  # type: ignore[no-untyped-def]
    resp = await api.client.get(path, headers=api.auth("admin"))
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_kubernetes_discovery_heartbeats_to_the_api(api, db, kube_stub: KubeStub,  # type: ignore[no-untyped-def]
                                                          kubeconfig: Path) -> None:
    resp = await api.client.post("/api/v1/apply", json={"items": [SITE, K8S_CLUSTER]}, headers=api.auth("prov-a"))
    assert resp.status == 200, await resp.text()
    kube_stub.add(make_node("h100-a", gpu_product="NVIDIA-H100-80GB-HBM3"),
                  make_node("h100-b", gpu_product="NVIDIA-H100-80GB-HBM3"),
                  make_pod("train-0", node="h100-a", gpus=3))

    await run_agent(AgentConfig(cluster="fra-k8s", server=_url(api), token=api.tokens["prov-a"],
                                kubeconfig=kubeconfig, once=True))

    got = await _get(api, "/api/v1/clusters/fra-k8s")
    assert got["status"]["ready"] == "True"
    assert got["status"]["allocatable"]["gpus"] == 13 and got["status"]["capacity"]["gpus"] == 16
    async with db.session() as session:
        row = (await session.execute(select(ClusterRow).where(ClusterRow.name == "fra-k8s"))).scalar_one()
    (pool,) = row.status["discoveredPools"]
    assert pool["pricePerGpuHour"] == "2.4500" and pool["nodes"] == 2


async def test_local_agent_registers_site_and_cluster(api) -> None:
    reg = Registration(site="lab-1", region="eu-west", price_per_gpu_hour="0.10")

    await run_agent(AgentConfig(cluster="lab-cpu", server=_url(api), token=api.tokens["prov-b"], local=True,
                                gpus=3, once=True, register=reg))

    site = await _get(api, "/api/v1/sites/lab-1")
    assert site["spec"]["provider"] == "prov-b" and site["spec"]["location"] == {"lat": 51.51, "lon": -0.13}
    got = await _get(api, "/api/v1/clusters/lab-cpu")
    assert got["spec"]["nodePools"][0]["gpusPerNode"] == 3 and got["spec"]["nodePools"][0]["gpu"]["model"] == "CPU"
    assert got["status"]["allocatable"]["gpus"] == 3 and got["status"]["ready"] == "True"

    # a second run finds the cluster and only heartbeats
    await run_agent(AgentConfig(cluster="lab-cpu", server=_url(api), token=api.tokens["prov-b"], local=True,
                                gpus=3, once=True, register=reg))


async def test_unknown_cluster_without_register_is_refused(api) -> None:
    with pytest.raises(ApiError) as info:
        await run_agent(AgentConfig(cluster="ghost", server=_url(api), token=api.tokens["prov-a"], local=True,
                                    once=True))
    assert info.value.status == 404


class Recorder:
    """A fake CPN API: serves one cluster and records heartbeats, failing the first `fail` of them."""

    def __init__(self, fail: int = 0, fail_status: int = 503):
        self.beats: list[dict] = []
        self.headers: list[str] = []
        self.fail, self.fail_status = fail, fail_status
        self.got_two = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/clusters/{name}", self.get_cluster)
        app.router.add_post("/api/v1/clusters/{name}/heartbeat", self.heartbeat)
        return app

    async def get_cluster(self, request: web.Request) -> web.Response:
        return web.json_response({**K8S_CLUSTER, "metadata": {"name": request.match_info["name"]}})

    async def heartbeat(self, request: web.Request) -> web.Response:
        self.headers.append(request.headers.get("Authorization", ""))
        if self.fail:
            self.fail -= 1
            error = {"code": "unavailable", "message": "database is down", "field": None}
            return web.json_response({"error": error}, status=self.fail_status)
        self.beats.append(await request.json())
        if len(self.beats) >= 2:
            self.got_two.set()
        return web.json_response({})


async def test_loop_retries_a_server_error_and_keeps_beating(aiohttp_server, kubeconfig: Path,
                                                             kube_stub: KubeStub, caplog) -> None:
    recorder = Recorder(fail=1)
    server = await aiohttp_server(recorder.app())
    kube_stub.add(make_node("l40s-a", gpu_product="NVIDIA-L40S", gpus=4))
    cfg = AgentConfig(cluster="c1", server=str(server.make_url("")), token="t0k", kubeconfig=kubeconfig,
                      interval=timedelta(seconds=0.05), price_per_gpu_hour="0.95")
    caplog.set_level("INFO", logger="cpn.agent")

    task = asyncio.create_task(run_agent(cfg))
    await asyncio.wait_for(recorder.got_two.wait(), timeout=30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert recorder.headers[0] == "Bearer t0k"
    beat = recorder.beats[0]
    HeartbeatRequest.model_validate(beat)
    assert beat["allocatableGpus"] == 4 and beat["capacityGpus"] == 4
    assert beat["nodePools"] == [{"name": "l40s", "gpu": {"model": "L40S", "memoryGB": 48, "tflops": 362.0},
                                  "gpusPerNode": 4, "nodes": 1, "pricePerGpuHour": "0.95"}]
    assert "database is down" in caplog.text and "heartbeat cluster=c1 ready=True allocatable=4/4" in caplog.text


async def test_a_refusal_stops_the_loop(aiohttp_server, kubeconfig: Path) -> None:
    server = await aiohttp_server(Recorder(fail=1, fail_status=403).app())
    cfg = AgentConfig(cluster="c1", server=str(server.make_url("")), kubeconfig=kubeconfig,
                      interval=timedelta(seconds=0.05))
    with pytest.raises(ApiError, match="database is down"):
        await asyncio.wait_for(run_agent(cfg), timeout=30)


async def test_failed_discovery_reports_not_ready_then_fails_once(aiohttp_server, tmp_path: Path) -> None:
    recorder = Recorder()
    server = await aiohttp_server(recorder.app())
    with KubeStub() as stub:
        path = stub.write_kubeconfig(tmp_path / "kubeconfig")

    with pytest.raises(Unavailable, match="unreachable"):
        await run_agent(AgentConfig(cluster="c1", server=str(server.make_url("")), kubeconfig=path, once=True,
                                    timeout=timedelta(seconds=2)))

    (beat,) = recorder.beats
    assert beat["allocatableGpus"] == 0 and "capacityGpus" not in beat and "nodePools" not in beat
    assert beat["conditions"][0]["status"] == "False" and beat["conditions"][0]["reason"] == "DiscoveryFailed"


def test_config_explains_what_to_fix() -> None:
    with pytest.raises(InvalidInput, match="either --kubeconfig"):
        AgentConfig(cluster="c", server="http://x")
    with pytest.raises(InvalidInput, match="--register works with --local"):
        AgentConfig(cluster="c", server="http://x", kubeconfig=Path("k"),
                    register=Registration(site="s", region="r", price_per_gpu_hour="1"))
    with pytest.raises(InvalidInput, match="positive decimal"):
        Registration(site="s", region="r", price_per_gpu_hour="free")


@pytest.mark.parametrize(("args", "message"), [
    (["--cluster", "c", "--local", "--once", "--server", "http://127.0.0.1:9"], "cannot reach"),
    (["--cluster", "c", "--once", "--server", "http://127.0.0.1:9"], "either --kubeconfig"),
    (["--cluster", "c", "--local", "--once"], "no server configured"),
    (["--cluster", "c", "--local", "--register", "--server", "http://127.0.0.1:9"], "--register needs"),
])
def test_cli_errors_are_one_line(args: list[str], message: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CPN_CONFIG", str(tmp_path / "none"))
    monkeypatch.delenv("CPN_SERVER", raising=False)
    monkeypatch.delenv("CPN_TOKEN", raising=False)

    result = CliRunner().invoke(agent_cmd, args)

    assert result.exit_code == 1 and message in result.stderr
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1


def test_the_agent_gives_kubernetes_pods_its_image(kubeconfig: Path) -> None:
    from cpn.agent.heartbeat import make_driver

    driver = make_driver(AgentConfig(cluster="fra-k8s", server="http://cpn.example", kubeconfig=kubeconfig,
                                     image="registry.example/cpn:1"))
    assert driver.image == "registry.example/cpn:1"  # pods run it unless the job names its own (spec.image)
    out = CliRunner().invoke(agent_cmd, ["--cluster", "c", "--local", "--image", "cpn:1", "--server", "http://x"])
    assert out.exit_code == 1 and "--kubeconfig" in out.output
