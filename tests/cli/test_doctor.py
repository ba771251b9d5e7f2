"""`cpn doctor` on this machine (issue 30, deliver 4): against a live server with a provider token it
reaches the API, reads the server's clock, finds no GPU and says which registered cluster matches
(a CPU-slot cluster does, an H100 one does not: exit 1 with the fix); against no server it exits 1
naming the api check. Always a JSON list of checks with name and ok, and fix when not ok."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from cpn.cli.doctor import check_disk, check_fabric


def _cluster(name: str, model: str) -> dict:
    return {"apiVersion": "cpn/v1", "kind": "Cluster", "metadata": {"name": name},
            "spec": {"site": "lab-1", "driver": "local", "nodePools": [{
                "name": "p", "gpu": {"model": model, "memoryGB": 80 if model != "CPU" else 4,
                                     "tflops": 989 if model != "CPU" else 0.2},
                "gpusPerNode": 2, "nodes": 1, "pricePerGpuHour": "0.10"}]}}


def _doctor(live_server, tmp_path: Path, *args: str) -> tuple[int, list[dict]]:  # type: ignore[no-untyped-def]
    env = {**live_server.env, "HOME": str(tmp_path)}  # no cpnctl context: only what the flags say
    env.pop("CPN_SERVER", None)
    env.pop("CPN_TOKEN", None)
    from tests.conftest import run_cli

    out = run_cli(["cpn", "doctor", "--json", "--state-dir", str(tmp_path / "state"), *args], env)
    checks = json.loads(out.stdout)
    assert all({"name", "ok"} <= set(c) and (c["ok"] or c.get("fix")) for c in checks), checks
    return out.returncode, checks


@pytest.mark.slow
def test_doctor_on_this_machine(live_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    token = live_server.token("lab", "provider")
    site = {"apiVersion": "cpn/v1", "kind": "Site", "metadata": {"name": "lab-1"}, "spec": {"region": "eu-west"}}
    out = live_server.cpnctl("--token", token, "--server", live_server.url, "apply", "-f", "-",
                             input=yaml.safe_dump_all([site, _cluster("lab-cpu", "CPU"), _cluster("lab-h100", "H100")]))
    assert out.returncode == 0, out.stderr
    (tmp_path / "token").write_text(token + "\n")
    auth = ["--server", live_server.url, "--token-file", str(tmp_path / "token")]

    code, checks = _doctor(live_server, tmp_path, *auth, "--cluster", "lab-cpu")
    by = {c["name"]: c for c in checks}
    assert by["api"]["ok"] and "as lab (provider)" in by["api"]["detail"], by["api"]
    assert by["clock"]["ok"], by["clock"]  # the server runs on this machine: same clock
    assert "no GPU" in by["devices"]["detail"] and by["cluster"]["ok"], checks
    assert code == 0, checks

    code, checks = _doctor(live_server, tmp_path, *auth, "--cluster", "lab-h100")
    cluster = {c["name"]: c for c in checks}["cluster"]
    assert code == 1 and not cluster["ok"] and "H100" in cluster["detail"] and "declare" in cluster["fix"], cluster

    code, checks = _doctor(live_server, tmp_path, "--server", "http://127.0.0.1:1")
    api = {c["name"]: c for c in checks}["api"]
    assert code == 1 and not api["ok"] and "cannot reach" in api["detail"], api


def test_the_fabric_and_disk_checks_read_this_machine(tmp_path: Path) -> None:
    ib = tmp_path / "infiniband"
    (ib / "mlx5_0").mkdir(parents=True)
    assert "hcas [mlx5_0]" in check_fabric(ib).detail
    assert "kind ethernet" in check_fabric(tmp_path / "none").detail
    disk = check_disk(tmp_path / "not" / "yet")
    assert disk.ok == (float(disk.detail.split()[0]) >= 5.0) and str(tmp_path) in disk.detail
