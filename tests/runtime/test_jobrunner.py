"""The job runner's hand-over to the API: a busy API's refusal (5xx, 429) keeps the metrics for the next
try, and the site learns that its sub-task ended only after the runner has sent the workers' last
metrics — a sub-task reported Succeeded lets the job turn Succeeded, after which reports are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cpn.runtime import jobrunner
from cpn.runtime.config import TrainConfig
from cpn.runtime.contract import AttemptSpec, Endpoint
from cpn.runtime.topology import Topology


def spec_of() -> AttemptSpec:
    return AttemptSpec(job="u/relay", attempt=1, subtask="relay-a", cluster="a", site_index=0, first_rank=0, workers=1,
                       topology=Topology(sites=[{"name": "a", "ranks": 1}]), train=TrainConfig(model="tiny", tokens=1 << 20),
                       elastic=False, rendezvous=Endpoint(host="127.0.0.1", port=1), server="http://api.test",
                       worker_token="cpn_worker_x")


def test_a_busy_api_keeps_the_batch_and_a_refusal_drops_it(tmp_path: Path) -> None:
    answers = [503, 429, 200, 409]
    seen: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(len(json.loads(request.content)["reports"]))
        return httpx.Response(answers[len(seen) - 1], json={})

    relay = jobrunner.Relay(tmp_path, spec_of(), httpx.Client(base_url="http://api.test",
                                                              transport=httpx.MockTransport(handler)))
    relay.pending = [{"rank": 0, "site": 0, "step": i} for i in range(3)]
    relay.flush()
    relay.flush()
    assert len(relay.pending) == 3  # 503 and 429: kept
    relay.flush()
    assert relay.pending == [] and seen == [3, 3, 3]
    relay.pending = [{"rank": 0, "site": 0, "step": 9}]
    relay.flush()  # 409 (the job ended): retrying cannot help
    assert relay.pending == []


def test_a_batch_refused_because_the_job_changed_meanwhile_is_sent_again(tmp_path: Path) -> None:
    """409 stale: the server kept nothing (seen in CI: the byo-text job's first val loss was lost so)."""
    answers = [(409, {"error": {"code": "stale", "message": "changed by someone else"}}), (200, {"accepted": 2})]
    seen: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(len(json.loads(request.content)["reports"]))
        status, body = answers[len(seen) - 1]
        return httpx.Response(status, json=body)

    relay = jobrunner.Relay(tmp_path, spec_of(), httpx.Client(base_url="http://api.test",
                                                              transport=httpx.MockTransport(handler)))
    relay.pending = [{"rank": 0, "site": 0, "step": i} for i in range(2)]
    relay.flush()
    assert len(relay.pending) == 2
    relay.flush()
    assert relay.pending == [] and seen == [2, 2]


def test_the_sub_task_ends_only_after_its_last_metrics_are_sent(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    phase_when_sent: list[str | None] = []
    tried: list[bool] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/metrics"):
            if not tried:  # the API is restarting: the first try times out
                tried.append(True)
                raise httpx.ConnectTimeout("restarting", request=request)
            status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else {}
            phase_when_sent.append(status.get("subtask", {}).get("phase"))
        return httpx.Response(200, json={"accepted": 1})

    def start(spec: AttemptSpec, run_dir: Path, ckpt: Path, code: Path | None = None,
              tee: bool = False, jail: jobrunner.Jail | None = None) -> list[jobrunner.Worker]:
        # a worker that writes its final report and exits at once, as a short run's rank does
        script = ("import json, pathlib; p = pathlib.Path('metrics'); p.mkdir(exist_ok=True); "
                  "(p / 'rank0.jsonl').write_text(json.dumps({'rank': 0, 'site': 0, 'step': 5, 'final': True}) + '\\n')")
        log = run_dir / "rank0.log"
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=run_dir, stdout=log.open("wb"),
                                stderr=subprocess.STDOUT)
        return [jobrunner.Worker(0, proc, log)]

    monkeypatch.setattr(jobrunner, "_client", lambda spec: httpx.Client(base_url="http://api.test",
                                                                         transport=httpx.MockTransport(handler)))
    monkeypatch.setattr(jobrunner, "_start", start)
    monkeypatch.setattr(jobrunner, "fetch_code", lambda *a: None)
    assert jobrunner.supervise(spec_of(), run_dir, tmp_path) == 0
    assert phase_when_sent and "Succeeded" not in phase_when_sent, phase_when_sent
    final = json.loads((run_dir / "status.json").read_text())
    assert final["phase"] == "Finished" and final["subtask"]["phase"] == "Succeeded"


def test_a_resumed_attempt_uploads_its_own_checkpoints_not_the_abandoned_runs(tmp_path: Path) -> None:
    """A site that survived a failure holds step folders newer than the step the next attempt resumes
    from (never complete at the API): they are dropped, and a step the new attempt saves again is
    uploaded again (the name alone said "sent")."""
    puts: list[tuple[str, bytes]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        puts.append((request.url.path.rsplit("/checkpoints/", 1)[1], request.content))
        return httpx.Response(201, json={})

    root = tmp_path / "checkpoints"
    for step, body in ((20, b"old-20"), (30, b"old-30")):
        (root / f"step-{step:08d}").mkdir(parents=True)
        (root / f"step-{step:08d}" / "site0.pt").write_bytes(body)
    sync = jobrunner.CheckpointSync(root, spec_of(), httpx.Client(base_url="http://api.test",
                                                                  transport=httpx.MockTransport(handler)))
    sync.prune_after(20)  # the attempt resumes from step 20
    assert sorted(p.name for p in root.iterdir()) == ["step-00000020"]
    sync.push()
    assert [name for name, _ in puts] == ["step-00000020/site0.pt"]
    (root / "step-00000030").mkdir()
    (root / "step-00000030" / "site0.pt").write_bytes(b"new-30")
    sync.push()
    path = root / "step-00000020" / "site0.pt"
    path.write_bytes(b"new-20, rewritten")  # the same step saved again
    sync.push()
    assert puts[1:] == [("step-00000030/site0.pt", b"new-30"), ("step-00000020/site0.pt", b"new-20, rewritten")]
