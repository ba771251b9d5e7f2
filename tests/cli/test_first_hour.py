"""The first hour of a new user, through `cpnctl` and `cpn` against a live server: every example job
is valid and gets quotes, errors are complete and one line, contexts do not switch behind the
user's back, `describe job` reads like kubectl, selectors and limits do what they say."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import yaml

from cpn.cli.demo import PROVIDERS, consents, world
from tests.conftest import run_cli

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "jobs").glob("*.yaml"))
FAMILIES = {"ddp", "hierarchical", "diloco", "local_sgd", "gossip", "ssp", "async_ps", "ps_backup", "auto"}


def demo_world(live_server) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """Two providers' three CPU sites (the demo's world), heartbeating, and a cpnctl context for alice
    (also on `live_server.user`); returns each site's provider token."""
    by_site = {}
    for provider in sorted(PROVIDERS, key=lambda p: p == "alpha-cloud"):  # alpha links to beta's site
        token = live_server.token(provider, "provider")
        out = live_server.cpnctl("--token", token, "--server", live_server.url, "apply", "-f", "-",
                                 input=yaml.safe_dump_all(world(provider)))
        assert out.returncode == 0, out.stderr
        for site in PROVIDERS[provider]:
            by_site[site] = token
            httpx.post(f"{live_server.url}/api/v1/clusters/{site}-cpu/heartbeat", timeout=10,
                       headers={"Authorization": f"Bearer {token}"},
                       json={"allocatableGpus": 1, "capacityGpus": 1,
                             "conditions": [{"type": "Ready", "status": "True"}]}).raise_for_status()
    for provider, sites in PROVIDERS.items():  # each provider accepts the links made to its sites (issue 35 M4)
        if consents(provider):
            out = live_server.cpnctl("--token", by_site[sites[0]], "--server", live_server.url, "apply", "-f", "-",
                                     input=yaml.safe_dump_all(consents(provider)))
            assert out.returncode == 0, out.stderr
    live_server.user = live_server.token("alice", "user")
    out = live_server.cpnctl("config", "set-context", "alice", "--server", live_server.url, "--token",
                             live_server.user)
    assert out.returncode == 0, out.stderr
    return by_site


@pytest.fixture
def hour(live_server):  # type: ignore[no-untyped-def]
    """The demo's world with contexts for its providers and a user."""
    demo_world(live_server)
    return live_server


def test_every_example_job_is_accepted_and_quoted(hour) -> None:  # type: ignore[no-untyped-def]
    strategies = {yaml.safe_load(p.read_text())["spec"]["strategy"] for p in EXAMPLES}
    assert strategies == FAMILIES, strategies
    for path in EXAMPLES:
        out = hour.cpnctl("apply", "-f", str(path))
        assert out.returncode == 0, (path.name, out.stderr)
        name = yaml.safe_load(path.read_text())["metadata"]["name"]
        assert f"trainingjob/{name} created" in out.stdout
        quotes = json.loads(hour.cpnctl("get", "quotes", name, "-o", "json").stdout)["items"]
        assert quotes, f"{path.name}: no quote"
        for q in quotes:
            assert q["placement"] and q["price"]["currency"] == "USD"
            if yaml.safe_load(path.read_text())["spec"]["strategy"] != "auto":
                assert q["strategy"] == yaml.safe_load(path.read_text())["spec"]["strategy"]


def test_quote_times_have_units_and_wait_on_a_quoted_job_says_accept(hour) -> None:  # type: ignore[no-untyped-def]
    assert hour.cpnctl("apply", "-f", str(EXAMPLES[0].parent / "auto.yaml")).returncode == 0
    table = hour.cpnctl("get", "quotes", "first-job").stdout.splitlines()
    assert "TIME" in table[0]
    items = json.loads(hour.cpnctl("get", "quotes", "first-job", "-o", "json").stdout)["items"]
    times = [q["predictedDuration"] for q in items]
    assert all(t.endswith((" s", " min", " h")) for t in times), times
    seconds = [q["predictedSeconds"] for q in items]
    assert len(set(times)) == len({round(s, 3) for s in seconds}), (times, seconds)  # distinct times read distinct
    out = hour.cpnctl("wait", "first-job", "--timeout", "5")
    assert out.returncode == 1
    assert "accept a quote first: cpnctl accept first-job --quote balanced" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_describe_job_reads_like_kubectl(hour, tmp_path) -> None:  # type: ignore[no-untyped-def]
    doc = yaml.safe_load((EXAMPLES[0].parent / "ddp.yaml").read_text())
    doc["spec"]["overlap"] = True  # a boolean the user set: printed as YAML writes it
    (tmp_path / "ddp.yaml").write_text(yaml.safe_dump(doc))
    assert hour.cpnctl("apply", "-f", str(tmp_path / "ddp.yaml")).returncode == 0
    assert hour.cpnctl("accept", "first-ddp", "--quote", "cheapest").returncode == 0
    out = hour.cpnctl("describe", "job", "first-ddp")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for bad in ("None", "True", "False", "masterPort", "meter", "billed", "global_batch_tokens", "inner_steps",
                "quoteLines", "sinceCheckpoint"):
        assert bad not in text.split("Conditions:")[0], (bad, text)  # kubectl's condition table says True
    assert "globalBatchTokens: 3072" in text and "overlap: true" in text
    assert "price: " in text and " USD" in text.split("price: ")[1].splitlines()[0]
    assert "predictedTime: " in text and text.split("predictedTime: ")[1].split()[1] in ("s", "min", "h")


def test_validation_errors_are_complete_and_one_line(hour, tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: cpn/v1\nkind: trainingjob\nmetadata: {name: bad}\n"
                   "spec: {model: huge, tokens: 1e5, gpus: 4, strategy: warp}\n")
    out = hour.cpnctl("apply", "-f", str(bad))
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1
    for words in ("spec.model", "llama-70b", "spec.gpus", "gpus: {min: 4, max: 4}", "spec.strategy", "async_ps"):
        assert words in out.stderr, (words, out.stderr)
    assert "spec.tokens" not in out.stderr  # 1e5 is a number
    assert "more)" not in out.stderr and "function-after" not in out.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("apiVersion: cpn/v1\nkind: TrainingJob\nmetadata:\n  name: x\n   bad: indent\n")
    out = hour.cpnctl("apply", "-f", str(broken))
    assert out.returncode == 1 and "line 5 column" in out.stderr, out.stderr
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("apiVersion: cpn/v1\nkind: Jobz\nmetadata: {name: x}\nspec: {}\n")
    out = hour.cpnctl("apply", "-f", str(wrong))
    assert out.returncode == 1 and "TrainingJob" in out.stderr and "Cluster" in out.stderr, out.stderr


def test_set_context_does_not_switch_silently(hour) -> None:  # type: ignore[no-untyped-def]
    out = hour.cpnctl("config", "set-context", "other", "--server", hour.url)
    assert out.returncode == 0
    assert 'Context "other" created' in out.stdout and "use-context other" in out.stdout
    assert hour.cpnctl("config", "current-context").stdout.strip() == "alice"
    out = hour.cpnctl("config", "use-context", "other")
    assert 'Switched to context "other"' in out.stdout
    assert hour.cpnctl("config", "current-context").stdout.strip() == "other"
    out = hour.cpnctl("config", "set-context", "alice", "--server", hour.url, "--use")
    assert 'Switched to context "alice"' in out.stdout


def test_selectors_limits_and_delete_from_a_file(hour, tmp_path) -> None:  # type: ignore[no-untyped-def]
    for name in ("ddp", "ssp", "gossip"):
        assert hour.cpnctl("apply", "-f", str(EXAMPLES[0].parent / f"{name}.yaml")).returncode == 0
    names = lambda out: [i["metadata"]["name"] for i in json.loads(out.stdout)["items"]]  # noqa: E731
    got = hour.cpnctl("get", "jobs", "-l", "team in (nlp)", "-o", "json")
    assert got.returncode == 0 and names(got) == ["first-ddp"], got.stderr
    got = hour.cpnctl("get", "jobs", "-l", "team notin (nlp),example", "-o", "json")
    assert names(got) == ["first-gossip", "first-ssp"]
    got = hour.cpnctl("get", "jobs", "-l", "team in nlp")
    assert got.returncode == 1 and "parentheses" in got.stderr
    got = hour.cpnctl("get", "jobs", "--limit", "2", "-o", "json")
    assert len(names(got)) == 2 and "more exist" in got.stderr
    assert len(names(hour.cpnctl("get", "jobs", "--limit", "3", "-o", "json"))) == 3
    out = hour.cpnctl("delete", "-f", str(EXAMPLES[0].parent / "ssp.yaml"))
    assert out.returncode == 0 and 'trainingjob "first-ssp" deleted' in out.stdout, out.stderr
    assert "first-ssp" not in names(hour.cpnctl("get", "jobs", "-o", "json"))


def test_token_create_refuses_a_database_that_is_not_the_servers(hour, tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {**hour.env, "CPN_DATA_DIR": str(tmp_path / "elsewhere")}
    env.pop("CPN_DATABASE_URL")
    out = run_cli(["cpn", "token", "create", "bob", "--role", "user"], env)
    assert out.returncode == 1 and out.stdout == ""
    assert str(tmp_path / "elsewhere" / "cpn.db") in out.stderr
    assert "CPN_DATA_DIR" in out.stderr and "CPN_DATABASE_URL" in out.stderr and "--init" in out.stderr
    assert not (tmp_path / "elsewhere" / "cpn.db").exists()
    out = run_cli(["cpn", "token", "create", "bob", "--role", "user", "--init"], env)
    assert out.returncode == 0 and out.stdout.startswith("cpn_"), out.stderr
    out = run_cli(["cpn", "token", "create", "carol", "--role", "user"], hour.env)  # the server's own database
    assert out.returncode == 0 and "token stored in" in out.stderr


@pytest.mark.db  # its second half runs in the PostgreSQL pass
def test_database_url_without_a_driver_means_asyncpg(tmp_path) -> None:
    env = {**os.environ, "CPN_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none"}
    out = run_cli(["cpn", "db", "current"], env)
    assert out.returncode == 1 and "psycopg" in out.stderr and "postgresql+asyncpg://" in out.stderr
    assert "No module named" not in out.stderr
    pg = os.environ.get("CPN_TEST_DATABASE_URL")
    if pg:  # the plain libpq form reaches the same database through asyncpg
        plain = pg.replace("postgresql+asyncpg://", "postgresql://")
        out = run_cli(["cpn", "db", "current"], {**os.environ, "CPN_DATABASE_URL": plain})
        assert out.returncode == 0, out.stderr


def test_serve_logs_its_address(live_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = live_server.url.rsplit(":", 1)[1]
    log = (tmp_path / f"server-{port}.log").read_text()
    assert f"CPN API serving on http://127.0.0.1:{port}" in log, log[-2000:]


def test_two_users_each_have_a_job_of_the_same_name(hour) -> None:  # type: ignore[no-untyped-def]
    example = str(EXAMPLES[0].parent / "auto.yaml")
    bob = hour.token("bob", "user")
    assert hour.cpnctl("apply", "-f", example).returncode == 0
    out = hour.cpnctl("--token", bob, "apply", "-f", example)
    assert out.returncode == 0 and "trainingjob/first-job created" in out.stdout, out.stderr
    admin = ("--token", hour.token("root", "admin"))
    table = hour.cpnctl(*admin, "get", "jobs").stdout.splitlines()
    assert table[0].split()[:2] == ["NAMESPACE", "NAME"]
    assert sorted(line.split()[0] for line in table[1:]) == ["alice", "bob"]
    ambiguous = hour.cpnctl(*admin, "get", "job", "first-job")
    assert ambiguous.returncode == 1 and len(ambiguous.stderr.strip().splitlines()) == 1
    assert "alice/first-job" in ambiguous.stderr and "-n NAMESPACE" in ambiguous.stderr
    for args in (("-n", "bob", "get", "job", "first-job"), ("get", "job", "bob/first-job")):
        got = hour.cpnctl(*admin, *args, "-o", "json")
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["metadata"]["namespace"] == "bob"
    assert "recommended" in hour.cpnctl(*admin, "-n", "bob", "get", "quotes", "first-job").stdout
    cancelled = hour.cpnctl(*admin, "cancel", "bob/first-job")
    assert cancelled.returncode == 0, cancelled.stderr
    mine = json.loads(hour.cpnctl("get", "job", "first-job", "-o", "json").stdout)  # alice's is untouched
    assert mine["status"]["phase"] == "Quoted" and mine["metadata"]["namespace"] == "alice"
