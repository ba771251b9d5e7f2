"""cpnctl against a real `cpn serve` process: contexts, get/apply/describe/delete, errors."""

from __future__ import annotations

import json
import os
import stat

import yaml

from tests.api.test_resource import WORLD_A, WORLD_B


def _yaml(items: list[dict]) -> str:
    return yaml.safe_dump_all(items, sort_keys=False)


def test_token_context_get_roundtrip(live_server) -> None:
    token = live_server.token("root", "admin")
    assert token.startswith("cpn_") and "\n" not in token
    out = live_server.cpnctl("config", "set-context", "local", "--server", live_server.url, "--token", token)
    assert out.returncode == 0, out.stderr
    cfg = live_server.env["CPN_CONFIG"]
    assert stat.S_IMODE(os.stat(cfg).st_mode) == 0o600
    assert live_server.cpnctl("config", "current-context").stdout.strip() == "local"
    got = live_server.cpnctl("get", "accounts", "-o", "json")
    assert got.returncode == 0, got.stderr
    body = json.loads(got.stdout)
    assert body["kind"] == "List" and body["apiVersion"] == "cpn/v1"
    assert [a["metadata"]["name"] for a in body["items"]] == ["root"]
    table = live_server.cpnctl("get", "account").stdout.splitlines()
    assert table[0].split() == ["NAME", "ROLE", "AGE"] and table[1].split()[:2] == ["root", "admin"]
    assert "root" in live_server.cpnctl("get", "accounts", "root", "-o", "yaml").stdout


def test_providers_apply_world_and_users_read_it(live_server) -> None:
    prov_a, prov_b = live_server.token("prov-a", "provider"), live_server.token("prov-b", "provider")
    user = live_server.token("alice", "user")
    live_server.cpnctl("config", "set-context", "a", "--server", live_server.url, "--token", prov_a)
    live_server.cpnctl("config", "set-context", "b", "--server", live_server.url, "--token", prov_b)
    live_server.cpnctl("config", "set-context", "u", "--server", live_server.url, "--token", user)
    out = live_server.cpnctl("--context", "a", "apply", "-f", "-", input=_yaml(WORLD_A))
    assert out.returncode == 0, out.stderr
    assert "cluster/fra-h100 created" in out.stdout
    assert live_server.cpnctl("--context", "b", "apply", "-f", "-", input=_yaml(WORLD_B)).returncode == 0
    # provider B may not touch provider A's cluster
    changed = json.loads(json.dumps(WORLD_A[2]))
    changed["spec"]["nodePools"][0]["pricePerGpuHour"] = "0.01"
    denied = live_server.cpnctl("--context", "b", "apply", "-f", "-", input=_yaml([changed]))
    assert denied.returncode == 1
    assert denied.stderr.startswith("error: ") and len(denied.stderr.strip().splitlines()) == 1
    assert "another account" in denied.stderr
    beat = live_server.cpnctl("--context", "a", "get", "clusters", "-o", "json")
    assert len(json.loads(beat.stdout)["items"]) == 5
    import httpx

    httpx.post(f"{live_server.url}/api/v1/clusters/fra-h100/heartbeat", json={"allocatableGpus": 9},
               headers={"Authorization": f"Bearer {prov_a}"}).raise_for_status()
    listed = json.loads(live_server.cpnctl("--context", "u", "get", "clusters", "-o", "json").stdout)["items"]
    alloc = {c["metadata"]["name"]: c["status"]["allocatable"]["gpus"] for c in listed}
    assert alloc["fra-h100"] == 9 and alloc["nyc-h100"] == 0
    table = live_server.cpnctl("--context", "u", "get", "cl").stdout
    assert table.splitlines()[0].split()[:4] == ["NAME", "READY", "GPUS", "GPU"]
    assert "9/16" in table
    wide = live_server.cpnctl("--context", "u", "get", "clusters", "-o", "wide").stdout
    assert "DRIVER" in wide and "local" in wide
    described = live_server.cpnctl("--context", "u", "describe", "cluster", "fra-h100").stdout
    assert "Conditions:" in described and "Ready" in described
    gone = live_server.cpnctl("--context", "a", "delete", "link", "fra-ams")
    assert gone.returncode == 0 and "deleted" in gone.stdout


def test_errors_are_one_line_exit_1(live_server, tmp_path) -> None:
    token = live_server.token("p", "provider")
    env_args = ["--server", live_server.url, "--token", token]
    bad = tmp_path / "bad.yaml"
    bad.write_text(_yaml([{"apiVersion": "cpn/v1", "kind": "Site", "metadata": {"name": "x"},
                           "spec": {"region": "eu", "bogus": 1}}]))
    out = live_server.cpnctl(*env_args, "apply", "-f", str(bad))
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0
    assert "spec.bogus" in out.stderr
    out = live_server.cpnctl(*env_args, "get", "widgets")
    assert out.returncode == 1 and "widgets" in out.stderr
    out = live_server.cpnctl("--server", "http://127.0.0.1:1", "get", "sites")
    assert out.returncode == 1 and "cannot reach" in out.stderr and "Traceback" not in out.stderr
    out = live_server.cpnctl(*env_args, "get", "site", "nope")
    assert out.returncode == 1 and "not found" in out.stderr
    (tmp_path / "broken.yaml").write_text("kind: [unclosed")
    out = live_server.cpnctl(*env_args, "apply", "-f", str(tmp_path / "broken.yaml"))
    assert out.returncode == 1 and "Traceback" not in out.stderr


def test_env_overrides_context(live_server) -> None:
    token = live_server.token("envuser", "user")
    env = {**live_server.env, "CPN_SERVER": live_server.url, "CPN_TOKEN": token}
    from tests.conftest import run_cli

    out = run_cli(["cpnctl", "get", "accounts", "-o", "json"], env)
    assert out.returncode == 0, out.stderr
    assert [a["metadata"]["name"] for a in json.loads(out.stdout)["items"]] == ["envuser"]
    assert "Client Version" in run_cli(["cpnctl", "version"], env).stdout
