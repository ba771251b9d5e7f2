"""The fabric, declared and used (issue 30, deliver 2): `Cluster.spec.fabric` is validated, the claim
of a sub-task carries its cluster's communication environment under `env` (and the workers get it),
and two clusters alike but for the fabric are quoted apart: the InfiniBand one is faster."""

from __future__ import annotations

from datetime import timedelta

from cpn.runtime.contract import AttemptSpec, worker_env
from layers.orchestration.lifecycle.reconciler import Reconciler, ReconcilerConfig


def _cluster(name: str, site: str, fabric: dict | None, gpus_per_node: int = 8, nodes: int = 4) -> dict:
    spec = {"site": site, "driver": "local", "nodePools": [{
        "name": "h100", "gpu": {"model": "H100", "memoryGB": 80, "tflops": 989},
        "gpusPerNode": gpus_per_node, "nodes": nodes, "pricePerGpuHour": "2.50"}]}
    if fabric is not None:
        spec["fabric"] = fabric
    return {"apiVersion": "cpn/v1", "kind": "Cluster", "metadata": {"name": name}, "spec": spec}


def _site(name: str) -> dict:
    return {"apiVersion": "cpn/v1", "kind": "Site", "metadata": {"name": name},
            "spec": {"region": "eu-central", "location": {"lat": 50.1, "lon": 8.7}}}


async def _apply(api, *docs: dict) -> None:  # type: ignore[no-untyped-def]
    resp = await api.client.post("/api/v1/apply", json={"items": list(docs)}, headers=api.auth("prov-a"))
    assert resp.status == 200, await resp.text()


async def _ready(api, cluster: str, gpus: int) -> None:  # type: ignore[no-untyped-def]
    resp = await api.client.post(f"/api/v1/clusters/{cluster}/heartbeat", headers=api.auth("prov-a"),
                                 json={"allocatableGpus": gpus, "capacityGpus": gpus,
                                       "conditions": [{"type": "Ready", "status": "True"}]})
    assert resp.status == 200, await resp.text()


def _job(name: str, **spec: object) -> dict:
    return {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"model": "tiny", "tokens": 120_000, "globalBatchTokens": 128 * 8, "strategy": "ddp",
                     "gpus": {"min": 1, "max": 1}, "sites": {"min": 1, "max": 1}, **spec}}


async def test_a_bad_fabric_is_refused_naming_the_field_and_an_old_interconnect_still_reads(api, db) -> None:  # type: ignore[no-untyped-def]
    await _apply(api, _site("ib"))
    resp = await api.client.post("/api/v1/apply", headers=api.auth("prov-a"), json={"items": [
        _cluster("eth-rdma", "ib", {"kind": "ethernet", "hcas": ["mlx5_0"]})]})
    assert resp.status == 422, await resp.text()
    assert "spec.fabric.hcas" in await resp.text() and "infiniband or roce" in await resp.text()
    resp = await api.client.post("/api/v1/apply", headers=api.auth("prov-a"), json={"items": [
        _cluster("warp", "ib", {"kind": "warp-drive"})]})
    assert resp.status == 422 and "spec.fabric.kind" in await resp.text(), await resp.text()
    old = _cluster("old", "ib", None)
    old["spec"]["interconnect"] = {"intraNodeGbps": 900, "interNodeGbps": 200}
    await _apply(api, old)
    got = await (await api.client.get("/api/v1/clusters/old", headers=api.auth("prov-a"))).json()
    assert got["spec"]["interconnect"]["interNodeGbps"] == 200


async def _claim_env(api, db, job: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    resp = await api.client.post("/api/v1/jobs", json=_job(job), headers=api.auth("alice"))
    assert resp.status in (200, 201), await resp.text()
    resp = await api.client.post(f"/api/v1/jobs/{job}/accept", json={"quote": "cheapest"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    await Reconciler(db, ReconcilerConfig(heartbeat_timeout=timedelta(seconds=60), lease_ttl=timedelta(hours=1),
                                          claim_timeout=timedelta(hours=1))).reconcile_once()
    listing = await (await api.client.get("/api/v1/subtasks?cluster=box", headers=api.auth("prov-a"))).json()
    (uid,) = [t["metadata"]["uid"] for t in listing["items"] if t["spec"]["job"] == f"alice/{job}"]
    resp = await api.client.post(f"/api/v1/subtasks/{uid}/claim", headers=api.auth("prov-a"),
                                 json={"rendezvous": {"host": "127.0.0.1", "port": 29500}})
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    spec = AttemptSpec.model_validate(body)
    workers = worker_env(spec, 0, run_dir="/r", checkpoint_dir="/c", base={"NCCL_IB_DISABLE": "agent's"})
    assert all(workers[k] == v for k, v in body["env"].items())  # the workers get it, over the agent's own
    return body["env"]


async def test_the_claim_carries_the_clusters_communication_environment(api, db) -> None:  # type: ignore[no-untyped-def]
    await _apply(api, _site("ib"), _cluster("box", "ib", {"kind": "infiniband", "hcas": ["mlx5_0", "mlx5_1"],
                                                          "gpuDirectRdma": True, "socketIfname": "ib0"}))
    await _ready(api, "box", 32)
    env = await _claim_env(api, db, "on-ib")
    assert env == {"NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_NET_GDR_LEVEL": "SYS",
                   "NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}, env
    await _apply(api, _cluster("box", "ib", {"kind": "roce", "hcas": ["mlx5_2"]}))
    env = await _claim_env(api, db, "on-roce")
    assert env == {"NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5_2", "NCCL_IB_GID_INDEX": "3"}, env
    await _apply(api, _cluster("box", "ib", {"kind": "ethernet", "socketIfname": "eth0"}))
    env = await _claim_env(api, db, "on-eth")
    assert env == {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}, env


async def test_infiniband_is_quoted_faster_than_ethernet_for_the_same_gpus(api, db) -> None:  # type: ignore[no-untyped-def]
    await _apply(api, _site("ib"), _site("eth"), _cluster("ib-h100", "ib", {"kind": "infiniband"}),
                 _cluster("eth-h100", "eth", {"kind": "ethernet"}))
    await _ready(api, "ib-h100", 32)
    await _ready(api, "eth-h100", 32)
    fastest = {}
    for site in ("ib", "eth"):  # 16 GPUs over two nodes: the gradients cross the fabric every step
        body = _job(f"on-{site}", model="llama3-1b", tokens=2_000_000_000, globalBatchTokens=16 * 4096,
                    gpus={"min": 16, "max": 16}, placement={"sites": [site]})
        resp = await api.client.post("/api/v1/jobs?dryRun=true", json=body, headers=api.auth("alice"))
        assert resp.status == 200, await resp.text()
        (quote,) = [q for q in (await resp.json())["status"]["quotes"] if q["label"] == "fastest"]
        assert [p["cluster"] for p in quote["placement"]] == [f"{site}-h100"]
        fastest[site] = quote["predictedSeconds"]
    print("fastest predictedSeconds", fastest)
    assert fastest["ib"] < 0.9 * fastest["eth"], fastest
