"""A metric batch re-sent after a lost answer is stored once (issue 36, item 6: metrics committed just
before the API died were sent again by the runner and stored twice). The runner's real relay talks to
a real app over HTTP; the first answer is lost on the way back, after the server committed."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select

from cpn.runtime import jobrunner
from cpn.runtime.contract import AttemptSpec
from cpn.runtime.metrics import HttpSink
from layers.orchestration.lifecycle.models import MetricBatchRow, MetricRow
from tests.api.billing_helpers import post_metrics, started
from tests.layers.orchestration.test_reconciler import _world


class LoseFirstAnswer(httpx.HTTPTransport):
    """Sends every request to the server; the first metrics POST's answer never comes back."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[dict[str, Any]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path.endswith("/metrics"):
            self.sent.append(json.loads(request.content))
            if len(self.sent) == 1:
                response.read()
                raise httpx.ReadError("connection reset before the answer arrived", request=request)
        return response


async def _rows(db, job: str) -> int:  # type: ignore[no-untyped-def]
    async with db.session() as s:
        return (await s.execute(select(func.count()).select_from(MetricRow).where(MetricRow.job == job))).scalar_one()


async def test_a_batch_resent_after_a_lost_answer_is_stored_once(api, db, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    contract = await started(api, db, "twice", ago=30)
    spec = AttemptSpec.model_validate({k: v for k, v in contract.items() if k != "uid"})
    lines = [{"rank": 0, "site": spec.site_index, "step": i, "tokens": 100 * i, "gpuSeconds": float(i)} for i in range(1, 12)]
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    transport = LoseFirstAnswer()
    client = httpx.Client(base_url=str(api.client.make_url("/")).rstrip("/"), transport=transport,
                          headers={"Authorization": f"Bearer {spec.worker_token}"})
    relay = jobrunner.Relay(tmp_path, spec, client)
    relay.collect()
    await asyncio.to_thread(relay.flush)  # stored, but the runner never hears it
    assert len(relay.pending) == 11 and await _rows(db, "alice/twice") == 11
    await asyncio.to_thread(relay.flush)  # the runner sends the same batch again
    assert relay.pending == []
    first, again = transport.sent
    assert first == again and len(first["batchId"]) >= 8, (first, again)
    assert await _rows(db, "alice/twice") == 11  # not 22
    async with db.session() as s:
        (batch,) = (await s.execute(select(MetricBatchRow).where(MetricBatchRow.job == "alice/twice"))).scalars()
    assert (batch.id, batch.accepted) == (first["batchId"], 11)

    # the answer the second time: 200 with what was stored, and the meter did not move
    status = (await (await api.client.get("/api/v1/jobs/twice", headers=api.auth("alice"))).json())["status"]
    resp = await api.client.post(f"{spec.job_path}/metrics", json=again,
                                 headers={"Authorization": f"Bearer {spec.worker_token}"})
    assert resp.status == 200 and await resp.json() == {"accepted": 11, "duplicate": True}, await resp.text()
    after = (await (await api.client.get("/api/v1/jobs/twice", headers=api.auth("alice"))).json())["status"]
    assert after.get("meter") == status.get("meter") and await _rows(db, "alice/twice") == 11


async def test_a_batch_without_an_id_still_works_and_a_bad_id_is_refused(api, db) -> None:  # type: ignore[no-untyped-def]
    """An older runner sends no `batchId`: stored as before (each time, as it always was)."""
    await _world(api)
    contract = await started(api, db, "old", ago=30)
    report = [{"rank": 0, "site": contract["site_index"], "step": 1, "tokens": 10, "gpuSeconds": 1.0}]
    for _ in range(2):
        resp = await post_metrics(api, contract["worker_token"], "old", report)
        assert resp.status == 200 and (await resp.json())["accepted"] == 1, await resp.text()
    assert await _rows(db, "alice/old") == 2
    resp = await api.client.post("/api/v1/jobs/alice%2Fold/metrics", json={"reports": report, "batchId": "x/../y"},
                                 headers={"Authorization": f"Bearer {contract['worker_token']}"})
    assert resp.status == 422 and "batchId" in await resp.text(), await resp.text()


def test_the_workers_http_sink_resends_the_same_batch_under_the_same_id() -> None:
    """The workers' own sink (``CPN_METRICS_URL``): a POST whose answer is lost keeps its id and its
    reports; reports emitted meanwhile go in the next batch, not into the re-sent one."""
    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            if len(bodies) == 1:
                self.close_connection = True  # stored, but no answer
                return
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sink = HttpSink(f"http://127.0.0.1:{server.server_port}/m", batch_size=2, interval=3600, timeout=5)
        sink.emit({"step": 1})
        sink.emit({"step": 2})  # sent: the answer is lost
        sink.emit({"step": 3})
        sink.flush()  # the same batch again, then the new report in a batch of its own
    finally:
        server.shutdown()
    assert [b["reports"] for b in bodies] == [[{"step": 1}, {"step": 2}]] * 2 + [[{"step": 3}]], bodies
    assert bodies[0]["batchId"] == bodies[1]["batchId"] != bodies[2]["batchId"]
