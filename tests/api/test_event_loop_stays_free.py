"""Issue 35's target: no request from any token holds the API's event loop more than 1 s. A real
`cpn serve` on a 40-site world gets the label selector that backtracked (C3), the YAML alias bomb (H1)
and a replicated pipeline quote (H2) while a second client times /healthz every 50 ms. A probe slower
than 1 s fails the test when the server's event-loop thread ran a second of CPU in that time and still did
not answer (the loop was held); one the machine did not give the loop CPU for (two cores shared with
other test processes) is only starvation, not a held loop."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from cpn.api.workers import worker_pids
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
@pytest.mark.serial  # it times /healthz: CI runs it alone, after the two-worker run
def test_no_request_holds_the_event_loop_a_second(live_server) -> None:  # type: ignore[no-untyped-def]
    _world(live_server.url, live_server.token("prov", "provider"))
    user = {"Authorization": f"Bearer {live_server.token('mallory', 'user')}"}
    stop, gaps, cpu = threading.Event(), [], []
    pid = live_server.proc.pid

    def probe() -> None:
        with httpx.Client(base_url=live_server.url, timeout=60) as c:
            while not stop.is_set():
                start, used = time.perf_counter(), _server_cpu(pid)
                assert c.get("/healthz").status_code == 200
                wall, used = time.perf_counter() - start, _server_cpu(pid) - used
                gaps.append(wall)
                cpu.append(used)
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
    held = [(round(g, 3), round(c, 3)) for g, c in zip(gaps, cpu, strict=False) if g >= 1.0 and c >= 1.0]
    assert len(gaps) > 5 and not held, f"(wall s, loop CPU s) of probes the loop held: {held}"
    assert max(gaps) < 30, sorted(zip(gaps, cpu, strict=False))[-5:]


def _server_cpu(pid: int) -> float:
    """CPU seconds (user + system) the event-loop (main) threads of the server and its workers have used."""
    total = 0
    for p in (pid, *worker_pids(pid)):
        try:
            fields = Path(f"/proc/{p}/task/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")
