"""`cpnctl get teams`, `get quotas` (used / limit), `describe quota`, and an accept refused for a quota, run
in this process against the `api` fixture's server (real HTTP on a local port)."""

from __future__ import annotations

from tests.api.test_jobs import job, register_world, submit
from tests.api.test_quotas import FOUR, accept, create, quota, team
from tests.cli import inproc


async def cpnctl(api, who: str, *args: str) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    """cpnctl as account `who`, in this process off the event loop (tests/cli/inproc.py)."""
    result = await inproc.cpnctl(api, who, *args)
    return result.code, result.stdout, result.stderr


async def test_get_and_describe_show_used_against_the_limit(api) -> None:
    await register_world(api)
    assert (await create(api, "teams", team("ml", "alice", "bob"))).status == 201
    assert (await create(api, "quotas", quota("ml-gpus", team="ml", maxGpus=8, spendPerMonth="500"))).status == 201
    assert (await submit(api, job("c1", **FOUR))).status == 201
    assert (await accept(api, "c1")).status == 200

    code, out, _ = await cpnctl(api, "admin", "get", "teams")
    assert code == 0 and out.split("\n")[0].split() == ["NAME", "MEMBERS", "QUOTAS", "AGE"], out
    assert out.split("\n")[1].split()[:3] == ["ml", "alice,bob", "ml-gpus"], out

    code, out, _ = await cpnctl(api, "alice", "get", "quotas")  # a member reads the quota binding her
    header, row = out.splitlines()[:2]
    assert code == 0 and header.split()[:4] == ["NAME", "BOUND", "TO", "GPUS"], out
    cells = row.split()
    assert cells[:5] == ["ml-gpus", "team/ml", "4/8", "-", "-"], out  # GPUS used/limit; no JOBS, GPU-HOURS limit
    assert cells[5].endswith("/500") and cells[6] == "USD", out

    code, out, _ = await cpnctl(api, "bob", "describe", "quota", "ml-gpus")
    assert code == 0 and "Limits:" in out, out
    limits = out[out.index("Limits:"):].splitlines()
    assert limits[1].split() == ["LIMIT", "USED", "OF", "COUNTS"]
    assert limits[2].split()[:3] == ["maxGpus", "4", "8"] and limits[3].split()[0] == "spendPerMonth", out

    code, _, err = await cpnctl(api, "alice", "delete", "quota", "ml-gpus")
    assert code == 1 and err.startswith("error: ") and "may not change Quota" in err, err


async def test_quotes_note_and_the_refused_accept_name_the_quota(api) -> None:
    await register_world(api)
    assert (await create(api, "quotas", quota("alice-gpus", account="alice", maxGpus=4))).status == 201
    for name in ("n1", "n2"):
        assert (await submit(api, job(name, **FOUR))).status == 201
    assert (await accept(api, "n1")).status == 200
    code, out, _ = await cpnctl(api, "alice", "get", "quotes", "n2")
    assert code == 0 and "over quota alice-gpus maxGpus (4 used + 4 > 4)" in out, out
    code, _, err = await cpnctl(api, "alice", "accept", "n2", "--quote", "cheapest")
    assert code == 1 and "quota 'alice-gpus' (account/alice) maxGpus: 4 GPUs used of a limit of 4" in err, err
