"""Issue 35's target: no request from any token holds the API's event loop more than 1 s. A real
`cpn serve` on a 40-site world gets the label selector that backtracked (C3), the YAML alias bomb (H1)
and a replicated pipeline quote (H2) while a second client times /healthz every 50 ms."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from layers.resource.catalog import generate_world
from tests.api.test_bounded_work import SELECTOR_BOMB, yaml_bomb


def _world(url: str, token: str) -> None:
    docs = generate_world(40, 80, seed=7, providers=1, links=780)
    for doc in docs:
        doc["metadata"]["labels"].pop("cpn.io/provider", None)
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
        r = c.post("/api/v1/apply", json={"items": docs})
        assert r.status_code == 200, r.text[:500]
        for doc in docs:
            if doc["kind"] == "Cluster":
                gpus = sum(p["gpusPerNode"] * p["nodes"] for p in doc["spec"]["nodePools"])
                r = c.post(f"/api/v1/clusters/{doc['metadata']['name']}/heartbeat",
                           json={"allocatableGpus": gpus, "conditions": [{"type": "Ready", "status": "True"}]})
                assert r.status_code == 200, r.text


@pytest.mark.slow
def test_no_request_holds_the_event_loop_a_second(live_server) -> None:  # type: ignore[no-untyped-def]
    _world(live_server.url, live_server.token("prov", "provider"))
    user = {"Authorization": f"Bearer {live_server.token('mallory', 'user')}"}
    stop, gaps = threading.Event(), []

    def probe() -> None:
        with httpx.Client(base_url=live_server.url, timeout=60) as c:
            while not stop.is_set():
                start = time.perf_counter()
                assert c.get("/healthz").status_code == 200
                gaps.append(time.perf_counter() - start)
                time.sleep(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    job = {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": "wide"},
           "spec": {"model": "llama-7b", "tokens": 2_000_000_000, "globalBatchTokens": 1_048_576,
                    "strategy": "pipeline", "parallelism": {"pipelineStages": 4, "dataReplicas": 3},
                    "gpus": {"min": 12, "max": 96}, "sites": {"min": 12, "max": 40}}}
    try:
        with httpx.Client(base_url=live_server.url, headers=user, timeout=300) as c:
            r = c.get("/api/v1/jobs", params={"labelSelector": SELECTOR_BOMB})
            assert r.status_code == 422 and r.json()["error"]["field"] == "labelSelector", r.text
            r = c.post("/api/v1/apply", content=yaml_bomb(), headers={"Content-Type": "application/yaml"})
            assert r.status_code == 422 and r.json()["error"]["field"] == "body", r.text
            for d in (2, 3, 4):
                job["spec"]["parallelism"]["dataReplicas"] = d
                job["spec"]["sites"]["min"] = 4 * d
                start = time.perf_counter()
                r = c.post("/api/v1/jobs", params={"dryRun": "true"}, json=job)
                assert r.status_code in (200, 422), r.text
                if r.status_code == 422:
                    assert r.json()["error"]["field"].startswith("spec."), r.text
                assert time.perf_counter() - start < 30
    finally:
        stop.set()
        prober.join(timeout=60)
    print(f"/healthz: {len(gaps)} probes, slowest {max(gaps):.3f} s")
    assert len(gaps) > 5 and max(gaps) < 1.0, sorted(gaps)[-5:]
