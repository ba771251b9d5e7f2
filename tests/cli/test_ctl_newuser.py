"""What a new user's exploratory session of `cpnctl` ran into, against a live server: `wait` stops with
"accept a quote first" when a profile run ends Quoted (it waited forever) and always prints a
currency; non-finite numbers in a manifest are one line naming the object and the field; invoices
(listed only by the API) can be read one by one; `cp` names a missing folder, not its `.part` file,
and draws no label off a terminal; negative timeouts are refused; `get quotes` says why a profiling
job has none and marks only an accepted quote CHOSEN; `top links` shows the links."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import yaml

from tests.cli.test_first_hour import demo_world

PROFILE_STEPS = 8  # layers/orchestration/jobs/profile.py: what the profile run's contract asks for


def _job(name: str, **spec) -> str:  # type: ignore[no-untyped-def]
    return yaml.safe_dump({"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": name},
                           "spec": {"model": "tiny", "tokens": 100 * 1024, "globalBatchTokens": 1024,
                                    "strategy": "ddp", "gpus": {"min": 1, "max": 1}, **spec}})


@pytest.fixture
def world(live_server):  # type: ignore[no-untyped-def]
    live_server.sites = demo_world(live_server)
    return live_server


def _call(server, token: str, method: str, path: str, **kw) -> dict:  # type: ignore[no-untyped-def]
    resp = httpx.request(method, f"{server.url}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=30, **kw)
    assert resp.status_code < 300, (path, resp.status_code, resp.text)
    return resp.json() if resp.content else {}


def _run_profile(server, name: str) -> None:  # type: ignore[no-untyped-def]
    """What a site agent and the job runner do for a profile run: claim, report steps, succeed."""
    (task,) = _call(server, server.user, "GET", f"/api/v1/jobs/{name}/subtasks")["items"]
    cluster, uid = task["spec"]["cluster"], task["metadata"]["uid"]
    provider = server.sites[task["spec"]["site"]]
    contract = _call(server, provider, "POST", f"/api/v1/subtasks/{uid}/claim",
                     json={"rendezvous": {"host": "127.0.0.1", "port": 29500}})
    _call(server, provider, "POST", f"/api/v1/subtasks/{uid}/status",
          json={"phase": "Running", "message": "", "exitCodes": {}})
    reports = [{"rank": 0, "site": 0, "step": s, "tokens": 1024 * s, "trainLoss": 5.0 - 0.1 * s,
                "wallSeconds": 3.0 + 0.5 * (s - 1), "gpuSeconds": 4.0 + 0.5 * (s - 1)}
               for s in range(1, PROFILE_STEPS + 1)]
    _call(server, f"{contract['worker_token']}", "POST", f"/api/v1/jobs/{quote(contract['job'], safe='')}/metrics",
          json={"reports": reports})
    _call(server, provider, "POST", f"/api/v1/subtasks/{uid}/status",
          json={"phase": "Succeeded", "message": "", "exitCodes": {"0": 0}})
    assert cluster


def test_wait_on_a_profile_run_stops_once_quoted_and_get_quotes_says_why_none(world) -> None:  # type: ignore[no-untyped-def]
    out = world.cpnctl("apply", "-f", "-", input=_job("prof", profile=True))
    assert out.returncode == 0, out.stderr
    assert world.cpnctl("get", "job", "prof", "-o", "json").stdout.count('"Profiling"') >= 1

    out = world.cpnctl("get", "quotes", "prof")  # before: "No resources found." as if there never would be
    assert out.returncode == 0 and out.stdout == "", out
    assert out.stderr.strip() == "No quotes yet: job alice/prof is Profiling; its quotes follow the profile run"
    out = world.cpnctl("describe", "quote", "prof")  # before: a bare "Not Found"
    assert out.returncode == 1 and "job alice/prof is Profiling" in out.stderr, out

    cmd = [str(Path(sys.executable).parent / "cpnctl"), "wait", "prof", "--timeout", "120", "--interval", "0.2"]
    waiting = subprocess.Popen(cmd, env=world.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)  # the wait has seen Profiling
        _run_profile(world, "prof")
        stdout, stderr = waiting.communicate(timeout=100)  # before: "still Quoted after 120s"
    finally:
        waiting.kill()
    assert waiting.returncode == 1, (stdout, stderr)
    assert "prof: Profiling" in stdout, stdout
    assert all(line.rstrip().endswith(" USD") for line in stdout.splitlines()), stdout  # before: "cost 0.00"
    assert stderr.strip().splitlines() == [
        "error: prof is Quoted and waits for you: accept a quote first: cpnctl accept prof --quote balanced "
        "(see the options with `cpnctl get quotes prof`)"], stderr


def test_chosen_marks_only_the_accepted_quote(world) -> None:  # type: ignore[no-untyped-def]
    out = world.cpnctl("apply", "-f", "-", input=_job("pick"))
    assert out.returncode == 0, out.stderr
    assert "*" not in out.stdout  # the quotes apply prints, none accepted

    def chosen() -> dict[str, str]:
        lines = world.cpnctl("get", "quotes", "pick").stdout.splitlines()
        start = lines[0].index("CHOSEN")
        return {line.split()[0]: line[start:start + 6].strip() for line in lines[1:]}

    before = chosen()
    assert "balanced" in before and set(before.values()) == {"-"}, before  # before: balanced had a `*`
    assert world.cpnctl("accept", "pick", "--quote", "cheapest").returncode == 0
    assert chosen() == {"cheapest": "*"}


@pytest.mark.parametrize(("field", "value"), [("tokens", "1e400"), ("globalBatchTokens", ".nan"),
                                              ("tokens", "-.inf")])
def test_non_finite_numbers_name_the_object_and_field(live_server, tmp_path: Path, field: str, value: str) -> None:  # type: ignore[no-untyped-def]
    lines = [f"  {field}: {value}" if line.startswith(f"  {field}:") else line
             for line in _job("nf").splitlines()]
    path = tmp_path / "nf.yaml"
    path.write_text("\n".join(lines))
    out = live_server.cpnctl("--server", live_server.url, "--token", live_server.token("alice", "user"),
                             "apply", "-f", str(path))
    assert out.returncode == 1  # before: "Out of range float values are not JSON compliant"
    assert out.stderr.strip() == f"error: trainingjob/nf: spec.{field}: must be a finite number", out.stderr


def test_a_dataset_size_that_is_not_finite_is_named(live_server) -> None:  # type: ignore[no-untyped-def]
    doc = {"apiVersion": "cpn/v1", "kind": "Dataset", "metadata": {"name": "corpus"},
           "spec": {"sizeGB": float("inf"), "sites": ["fra-1"]}}
    text = json.dumps(doc)  # Python writes Infinity; json.loads reads it back as inf
    out = live_server.cpnctl("--server", live_server.url, "--token", live_server.token("alice", "user"),
                             "apply", "-f", "-", input=text)
    assert out.returncode == 1
    assert out.stderr.strip() == "error: dataset/corpus: spec.sizeGB: must be a finite number", out.stderr


def test_one_invoice_by_name_and_a_missing_one_named(world) -> None:  # type: ignore[no-untyped-def]
    assert world.cpnctl("apply", "-f", "-", input=_job("billed")).returncode == 0
    assert world.cpnctl("accept", "billed").returncode == 0
    assert world.cpnctl("cancel", "billed").returncode == 0
    listed = json.loads(world.cpnctl("get", "invoices", "-o", "json").stdout)["items"]
    assert len(listed) == 1, listed
    name = listed[0]["metadata"]["name"]

    out = world.cpnctl("get", "invoice", name)  # before: "error: Not Found"
    assert out.returncode == 0 and out.stdout.splitlines()[1].startswith(name), out
    out = world.cpnctl("get", "invoice", name, "-o", "json")
    assert json.loads(out.stdout) == listed[0]
    out = world.cpnctl("describe", "invoice", name)
    assert out.returncode == 0 and f"Name:         {name}" in out.stdout and "Kind:         Invoice" in out.stdout

    for argv in (("get", "invoice", "nope"), ("describe", "invoice", "nope"), ("get", "invoices", "billed")):
        out = world.cpnctl(*argv)
        wanted = argv[2]
        assert out.returncode == 1 and out.stderr.startswith(f'error: invoice "{wanted}" not found'), (argv, out)
        assert "--job" in out.stderr


def test_cp_names_a_missing_folder_and_draws_no_label_off_a_terminal(world, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = world.cpnctl("cp", "job/none:final", "/nonexistent/dir/x.pt")
    assert out.returncode == 1
    assert out.stderr.strip() == "error: /nonexistent/dir: no such directory", out.stderr
    out = world.cpnctl("cp", "job/none:final", str(tmp_path / "x.pt"))  # no such job: the server's 404
    assert out.returncode == 1 and "none:final" not in out.stderr.splitlines()[0], out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr  # before: a stray "none:final" line first
    assert not list(tmp_path.glob("x.pt*"))


@pytest.mark.parametrize("argv", [("wait", "w1", "--timeout", "-1"), ("wait", "w1", "--interval", "0"),
                                  ("wait", "w1", "--interval", "-2")])
def test_negative_durations_are_refused(live_server, argv: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    out = live_server.cpnctl("--server", live_server.url, *argv)
    assert out.returncode == 1 and f"'{argv[2]}'" in out.stderr and "range" in out.stderr, out.stderr


def test_top_links(world) -> None:  # type: ignore[no-untyped-def]
    out = world.cpnctl("top", "links")
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split()[:3] == ["LINK", "A", "B"] and "JOBS" in header
    assert any(r.split()[:3] == ["fra-1--ams-1", "fra-1", "ams-1"] and r.split()[-1] == "0" for r in rows), rows
    data = json.loads(world.cpnctl("top", "links", "-o", "json").stdout)
    assert {i["metadata"]["name"] for i in data["items"]} >= {"fra-1--ams-1", "ams-1--nyc-1"}


def test_an_empty_listing_names_the_namespace_it_looked_in(world) -> None:  # type: ignore[no-untyped-def]
    """A new user's session: `-n bob get jobs` as alice said only "No resources found." (bob has jobs;
    alice sees her own namespace's)."""
    out = world.cpnctl("-n", "bob", "get", "jobs")
    assert out.returncode == 0 and "No resources found in namespace bob." in out.stderr, out.stderr
