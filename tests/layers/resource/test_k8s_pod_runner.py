"""What a Kubernetes pod runs, run here: the exact command, environment and mounted contract of the
kubernetes driver's Job (paths moved under a temporary directory), against a small HTTP server that
answers like CPN's API. The pod's job runner fetches the user's bundle with the worker token,
verifies and runs it, resumes a later attempt from the blob store's newest complete checkpoint (or
restarts cleanly and says so), uploads new checkpoint files, and prefixes each worker's lines with
its global rank."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from cpn.runtime import bundle
from cpn.runtime.config import TrainConfig
from cpn.runtime.contract import AttemptSpec, CodeRef, Endpoint
from cpn.runtime.topology import Topology
from layers.resource.drivers.kubernetes import PodSettings, Shape, job_manifest, secret_manifest

TOKEN = "cpn_worker_p0d"
TOPOLOGY = Topology(sites=[{"name": "east", "ranks": 1}, {"name": "west", "ranks": 2}],
                    links=[{"a": "east", "b": "west", "bandwidth_mbps": 1000.0, "rtt_ms": 40.0}])
LATEST = {"step": 4, "sites": [0, 1],
          "files": ["step-00000004/global.pt", "step-00000004/site0.pt", "step-00000004/site1.pt"]}
USER_CODE = '''
import json, os, pathlib

def main():
    args = json.loads(os.environ["CPN_CODE_ARGS"])
    rank = os.environ["RANK"]
    seen = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "CPN_CODE_DIR", "CPN_CHECKPOINT_DIR",
                                            "CPN_TRAIN_CONFIG", "MASTER_ADDR", "MASTER_PORT")}
    token = pathlib.Path(args["out"], "token").read_text()  # not in args: they are in the environment
    seen["token_in_env"] = any(token in v for v in os.environ.values())
    pathlib.Path(args["out"], f"seen-{rank}.json").write_text(json.dumps(seen))
    ckpt = pathlib.Path(os.environ["CPN_CHECKPOINT_DIR"], "step-00000008")
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "site1.pt").write_bytes(b"new weights")
    print(f"hello from rank {rank}", flush=True)
'''


class FakeApi(BaseHTTPRequestHandler):
    """The endpoints a job runner calls, recording each request with its bearer token."""

    bundle_bytes: bytes = b""
    has_checkpoint = True
    seen: list[tuple[str, str, str | None]] = []

    def _send(self, status: int, body: bytes = b"", kind: str = "application/octet-stream") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _record(self) -> None:
        self.seen.append((self.command, self.path, self.headers.get("Authorization")))

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._record()
        if self.path.startswith("/api/v1/bundles/"):
            return self._send(200, self.bundle_bytes)
        if self.path == "/api/v1/jobs/llm/checkpoints/latest":
            if not self.has_checkpoint:
                return self._send(404, b'{"message": "no checkpoint"}', "application/json")
            return self._send(200, json.dumps(LATEST).encode(), "application/json")
        if self.path.startswith("/api/v1/jobs/llm/checkpoints/step-00000004/"):
            return self._send(200, f"weights of {self.path.rsplit('/', 1)[1]}".encode())
        return self._send(404)

    def do_PUT(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._record()
        self._send(201, b"{}", "application/json")

    do_POST = do_PUT  # noqa: N815 - metrics

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api() -> Iterator[tuple[str, type[FakeApi]]]:
    handler = type("Api", (FakeApi,), {"seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def user_job(tmp_path: Path, server: str, attempt: int) -> tuple[AttemptSpec, bytes]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "usermod.py").write_text(USER_CODE)
    data, digest = bundle.pack(src, 1 << 20)
    out = tmp_path / "out"
    out.mkdir()
    (out / "token").write_text(TOKEN)
    code = CodeRef(digest=digest, entrypoint="usermod:main", args={"out": str(out)})
    spec = AttemptSpec(job="llm", attempt=attempt, subtask="llm-west", cluster="k8s-west", site_index=1,
                       first_rank=1, workers=2, topology=TOPOLOGY, train=TrainConfig(model="tiny", tokens=4096),
                       elastic=False, rendezvous=Endpoint(host="127.0.0.1", port=29999), server=server,
                       worker_token=TOKEN, image="cpn:test", code=code)
    return spec, data


def run_pod(spec: AttemptSpec, tmp_path: Path, index: int) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Pod `index` of the sub-task's Job (one rank a pod), as the kubelet would start it."""
    job = job_manifest(spec, "train", Shape(2, 1, 0), PodSettings(image="cpn:test"))
    container = job["spec"]["template"]["spec"]["containers"][0]
    contract = tmp_path / "contract"
    contract.mkdir()
    secret = secret_manifest(spec, "train")
    (contract / "spec.json").write_bytes(base64.b64decode(secret["data"]["spec.json"]))
    moves = {"/var/run/cpn": str(contract), "/var/lib/cpn": str(tmp_path / "work"),
             "/dev/termination-log": str(tmp_path / "termination-log"), "$(JOB_COMPLETION_INDEX)": str(index)}
    argv = []
    for arg in container["command"]:
        for old, new in moves.items():
            arg = arg.replace(old, new)
        argv.append(arg)
    assert argv[0] == "python"
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env |= {"JOB_COMPLETION_INDEX": str(index), "PATH": os.environ["PATH"],
            "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True, text=True, timeout=120)
    return done, tmp_path / "work"


def test_a_pod_fetches_verifies_and_runs_the_users_bundle_and_resumes(api: tuple[str, type[FakeApi]],
                                                                       tmp_path: Path) -> None:
    url, handler = api
    spec, handler.bundle_bytes = user_job(tmp_path, url, attempt=2)
    done, work = run_pod(spec, tmp_path, index=1)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[rank2]: hello from rank 2" in done.stdout.splitlines()  # pod 1 runs global rank 2 only
    assert "resuming from the checkpoint of step 4" in done.stdout
    assert (tmp_path / "termination-log").read_text() == "resuming from the checkpoint of step 4"
    seen = json.loads((tmp_path / "out" / "seen-2.json").read_text())
    assert not (tmp_path / "out" / "seen-1.json").exists()
    hexdigest = spec.code.digest.removeprefix("sha256:") if spec.code else ""
    assert seen["CPN_CODE_DIR"] == str(work / "code" / hexdigest)  # verified and unpacked by digest
    assert (seen["RANK"], seen["LOCAL_RANK"], seen["MASTER_ADDR"], seen["MASTER_PORT"]) == ("2", "0", "127.0.0.1",
                                                                                            "29999")
    assert seen["CPN_CHECKPOINT_DIR"] == str(work / "checkpoints")
    assert json.loads(seen["CPN_TRAIN_CONFIG"])["resume"] == str(work / "checkpoints")
    assert (work / "checkpoints" / "step-00000004" / "site1.pt").read_bytes() == b"weights of site1.pt"
    assert json.loads((work / "checkpoints" / "latest.json").read_text()) == {"step": 4, "sites": [0, 1]}
    assert seen["token_in_env"] is False  # workers never hold the worker token: the runner relays
    calls = {(method, path) for method, path, _ in handler.seen}
    assert ("GET", f"/api/v1/bundles/{hexdigest}") in calls
    assert ("PUT", "/api/v1/jobs/llm/checkpoints/step-00000008/site1.pt") in calls  # the new one, to the store
    assert ("PUT", "/api/v1/jobs/llm/checkpoints/step-00000004/site1.pt") not in calls  # fetched, not re-sent
    assert {auth for _, _, auth in handler.seen} == {f"Bearer {TOKEN}"}


def test_a_pod_without_a_checkpoint_to_resume_restarts_cleanly_and_says_so(api: tuple[str, type[FakeApi]],
                                                                          tmp_path: Path) -> None:
    url, handler = api
    handler.has_checkpoint = False
    spec, handler.bundle_bytes = user_job(tmp_path, url, attempt=3)
    done, _ = run_pod(spec, tmp_path, index=0)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no complete checkpoint exists: starting from step 0" in done.stdout
    assert "[rank1]: hello from rank 1" in done.stdout.splitlines()
    seen = json.loads((tmp_path / "out" / "seen-1.json").read_text())
    assert json.loads(seen["CPN_TRAIN_CONFIG"])["resume"] is None


def test_a_pod_refuses_a_bundle_whose_digest_does_not_match(api: tuple[str, type[FakeApi]], tmp_path: Path) -> None:
    url, handler = api
    spec, data = user_job(tmp_path, url, attempt=1)
    handler.bundle_bytes = data + b"tampered"
    done, _ = run_pod(spec, tmp_path, index=0)
    assert done.returncode == 1
    assert "digest mismatch" in (tmp_path / "termination-log").read_text()
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["token"]  # nothing of the user's ran
