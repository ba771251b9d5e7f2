"""Each job its own devices (issue 30, deliver 1): a local agent declaring 8 devices on this CPU
machine launches two jobs' sub-tasks whose workers' environments name disjoint CUDA_VISIBLE_DEVICES;
after an agent restart (the assignment restored from the re-adopted contracts) a third job gets the
free ones. The agent runs against the real API and reconciler; the driver records each worker's
environment as the job runner builds it (worker_env) and re-adopts what it launched from the
contracts' JSON, as the local driver does from its run directories."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from cpn.agent.devices import DevicePool
from cpn.agent.work import WorkLoop
from cpn.cli.ctl.output import describe
from cpn.runtime.contract import AttemptSpec, Devices, Endpoint, worker_env
from cpn.runtime.device import select_device
from layers.orchestration.lifecycle.reconciler import Reconciler, ReconcilerConfig
from layers.resource.drivers.base import DriverError, LogLine, SubtaskState
from tests.agent.test_work import _url
from tests.layers.orchestration.test_reconciler import _job

CLUSTER = "box-8"


class RecordingSite:
    """Launches succeed and run until stopped; each launch records its workers' environments."""

    name = "local"

    def __init__(self) -> None:
        self.launched: dict[str, AttemptSpec] = {}  # job -> its contract as written to the run directory
        self.visible: dict[str, list[str]] = {}  # job -> CUDA_VISIBLE_DEVICES of each of its workers

    async def launch(self, spec: AttemptSpec) -> dict[str, Any]:
        self.launched[spec.job] = AttemptSpec.model_validate_json(spec.model_dump_json())
        self.visible[spec.job] = [worker_env(spec, r, run_dir="/r", checkpoint_dir="/c", base={})
                                  ["CUDA_VISIBLE_DEVICES"] for r in spec.ranks]
        return {"job": spec.job}

    async def poll(self, spec: AttemptSpec, handle: dict[str, Any]) -> SubtaskState:
        return SubtaskState("Running", exit_codes={str(r): None for r in spec.ranks})

    async def cancel(self, spec: AttemptSpec, handle: dict[str, Any]) -> None:
        pass

    async def adopt(self) -> list[tuple[AttemptSpec, dict[str, Any]]]:
        return [(spec, {"job": job}) for job, spec in self.launched.items()]

    async def logs(self, spec: AttemptSpec, handle: dict[str, Any],
                   cursor: dict[str, Any]) -> tuple[list[LogLine], dict[str, Any]]:
        return [], cursor


async def _world(api) -> None:  # type: ignore[no-untyped-def]
    docs = [{"apiVersion": "cpn/v1", "kind": "Site", "metadata": {"name": "box"},
             "spec": {"region": "eu-central", "location": {"lat": 50.1, "lon": 8.7}}},
            {"apiVersion": "cpn/v1", "kind": "Cluster", "metadata": {"name": CLUSTER},
             "spec": {"site": "box", "driver": "local", "nodePools": [{
                 "name": "slots", "gpu": {"model": "CPU", "memoryGB": 4, "tflops": 0.2},
                 "gpusPerNode": 8, "nodes": 1, "pricePerGpuHour": "0.05"}]}}]
    resp = await api.client.post("/api/v1/apply", json={"items": docs}, headers=api.auth("prov-a"))
    assert resp.status == 200, await resp.text()
    resp = await api.client.post(f"/api/v1/clusters/{CLUSTER}/heartbeat", headers=api.auth("prov-a"),
                                 json={"allocatableGpus": 8, "capacityGpus": 8,
                                       "conditions": [{"type": "Ready", "status": "True"}]})
    assert resp.status == 200, await resp.text()


async def _accept(api, name: str, gpus: int) -> None:  # type: ignore[no-untyped-def]
    manifest = _job(name, gpus={"min": gpus, "max": gpus}, globalBatchTokens=gpus * 128 * 8)
    resp = await api.client.post("/api/v1/jobs", json=manifest, headers=api.auth("alice"))
    assert resp.status in (200, 201), await resp.text()
    resp = await api.client.post(f"/api/v1/jobs/{name}/accept", json={"quote": "cheapest"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()


async def _passes(reconciler: Reconciler, agent: WorkLoop, n: int = 3) -> None:
    for _ in range(n):
        await reconciler.reconcile_once()
        agent.version = None
        await agent.watch_once()
        await agent.monitor_once()


@pytest.mark.slow
async def test_two_jobs_get_disjoint_devices_and_a_restarted_agent_gives_a_third_the_free_ones(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    reconciler = Reconciler(db, ReconcilerConfig(heartbeat_timeout=timedelta(seconds=60),
                                                 lease_ttl=timedelta(hours=1), claim_timeout=timedelta(hours=1)))
    site = RecordingSite()
    agent = WorkLoop(_url(api), api.tokens["prov-a"], CLUSTER, site, advertise="127.0.0.1",
                     devices=DevicePool.discover(8))
    assert agent.devices is not None and agent.devices.kind == "slot"  # no GPU here: the declared count
    try:
        await _accept(api, "first", 3)
        await _accept(api, "second", 3)
        await _passes(reconciler, agent)
    finally:
        agent.close()
    first, second = site.visible["alice/first"], site.visible["alice/second"]
    assert len(set(first)) == len(set(second)) == 1  # every worker of a sub-task sees the sub-task's set
    a, b = set(first[0].split(",")), set(second[0].split(","))
    assert len(a) == len(b) == 3 and not a & b, (a, b)
    assert site.launched["alice/first"].devices is not None  # recorded in the contract the run directory keeps

    restarted = WorkLoop(_url(api), api.tokens["prov-a"], CLUSTER, site, advertise="127.0.0.1",
                         devices=DevicePool.discover(8))
    try:
        await restarted.adopt()
        assert len(restarted.runs) == 2  # both re-adopted, their devices held again
        await _accept(api, "third", 2)
        await _passes(reconciler, restarted)
    finally:
        restarted.close()
    c = set(site.visible["alice/third"][0].split(","))
    assert c == {str(i) for i in range(8)} - a - b, (a, b, c)
    resp = await api.client.get("/api/v1/jobs/first/subtasks", headers=api.auth("alice"))
    (item,) = (await resp.json())["items"]
    assert set(item["status"]["devices"]) == a  # reported by the agent: `cpnctl describe job` shows it
    assert ",".join(item["status"]["devices"]) in describe({"kind": "TrainingJob", "metadata": {"name": "first"},
                                                             "subtasks": [item]})


def _spec(workers: int, subtask: str = "alice/x-box-8") -> AttemptSpec:
    from cpn.runtime.config import TrainConfig
    from cpn.runtime.topology import SiteSpec, Topology

    return AttemptSpec(job="alice/x", attempt=1, subtask=subtask, cluster=CLUSTER, site_index=0, first_rank=0,
                       workers=workers, topology=Topology(sites=[SiteSpec(name="box", ranks=workers)], links=[]),
                       train=TrainConfig(), elastic=False, rendezvous=Endpoint(host="127.0.0.1", port=29500))


def test_a_sub_task_whose_devices_are_not_there_fails_at_launch_with_the_reason() -> None:
    pool = DevicePool("slot", [str(i) for i in range(4)])
    pool.assign(_spec(3, "a"))
    with pytest.raises(DriverError, match="needs 2 device.*1 of this site's 4.*not there"):
        pool.assign(_spec(2, "b"))
    gpus = DevicePool("cuda", ["0", "1"])  # GPUs the agent found once, gone now (this machine has none)
    with pytest.raises(DriverError, match="no longer visible"):
        gpus.assign(_spec(1, "c"))
    pool.release(_spec(3, "a"))
    assert pool.assign(_spec(2, "b")).ids == ["0", "1"]


def test_a_worker_given_gpus_that_it_cannot_see_refuses_the_cpu() -> None:
    env = worker_env(_spec(1).model_copy(update={"devices": Devices(kind="cuda", ids=["5"])}), 0, run_dir="/r",
                     checkpoint_dir="/c", base={})
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and env["CPN_DEVICES"] == "cuda"
    with pytest.raises(RuntimeError, match="assigned GPUs 5.*refusing to train on the CPU"):
        select_device("auto", env)
    slots = worker_env(_spec(1).model_copy(update={"devices": Devices(kind="slot", ids=["5"])}), 0, run_dir="/r",
                       checkpoint_dir="/c", base={})
    assert select_device("auto", slots).type == "cpu"  # CPU slots train on the CPU as before
