"""Worker tokens per attempt and per sub-task (issue 35, Deliver 2, M1, M2; issue 36, item 2): minted
once, on the sub-task's one claim; valid for its own site and ranks in its own attempt; revoked when the
sub-task ends or is lost, so nothing reported after that is taken or billed."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select

from layers.orchestration.identity.models import Token
from layers.orchestration.lifecycle.models import SubtaskRow
from layers.orchestration.lifecycle.reconciler import Reconciler, ReconcilerConfig
from tests.api.billing_helpers import OWNER, _job_of, claim, invoice, post_metrics, silence, started
from tests.layers.orchestration.test_reconciler import _reconciler, _world


def _deaf_after(db, seconds: float) -> Reconciler:  # type: ignore[no-untyped-def]
    return Reconciler(db, ReconcilerConfig(heartbeat_timeout=timedelta(seconds=seconds), lease_ttl=timedelta(hours=1),
                                           claim_timeout=timedelta(hours=1)))


async def test_a_re_claim_mints_no_second_token(api, db) -> None:  # type: ignore[no-untyped-def]
    """Every claim minted a fresh worker token, so a provider's token collected as many as it liked."""
    await _world(api)
    contract = await started(api, db, "once")
    resp = await api.client.post(f"/api/v1/subtasks/{contract['uid']}/claim", headers=api.auth(OWNER[contract["cluster"]]),
                                 json={"rendezvous": {"host": "127.0.0.1", "port": 29501}})
    assert resp.status == 409, await resp.text()
    assert "claimed once" in (await resp.json())["error"]["message"]
    async with db.session() as s:
        minted = (await s.execute(select(func.count()).select_from(Token).where(Token.job == "alice/once"))).scalar()
        bound = (await s.execute(select(Token.subtask).where(Token.job == "alice/once"))).scalars().all()
    assert (minted, bound) == (1, [contract["uid"]])


async def test_a_token_speaks_only_for_its_own_site_and_ranks(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    contract = await started(api, db, "mine", ago=30)
    token, site = contract["worker_token"], contract["site_index"]
    resp = await post_metrics(api, token, "mine", [{"rank": 0, "site": site, "step": 1, "tokens": 1}])
    assert resp.status == 200, await resp.text()
    for i, bad in ((0, {"rank": 7, "site": site}), (0, {"rank": 0, "site": site + 1})):
        resp = await post_metrics(api, token, "mine", [{**bad, "step": 2, "tokens": 2}])
        assert resp.status == 403, await resp.text()
        assert f"reports[{i}]." in await resp.text()


async def test_a_lost_subtasks_token_is_refused_and_nothing_after_the_loss_is_billed(api, db) -> None:  # type: ignore[no-untyped-def]
    """Issue 36, item 2: a SIGKILLed agent's orphaned worker trained on and was billed 62 s after its
    site was declared lost."""
    await _world(api)
    contract = await started(api, db, "orphan", ago=60)
    token, site = contract["worker_token"], contract["site_index"]
    resp = await post_metrics(api, token, "orphan", [{"rank": 0, "site": site, "step": 1, "tokens": 64, "gpuSeconds": 20.0}])
    assert resp.status == 200, await resp.text()
    await silence(db, contract["cluster"])
    await _deaf_after(db, 30).reconcile_once()  # its agent went silent: the sub-task is Lost
    async with db.session() as s:
        assert (await s.execute(select(SubtaskRow.phase).where(SubtaskRow.id == contract["uid"]))).scalar() == "Lost"
    before = await invoice(api, "orphan")
    resp = await post_metrics(api, token, "orphan", [{"rank": 0, "site": site, "step": 9, "tokens": 640, "gpuSeconds": 55.0}])
    assert resp.status == 401, await resp.text()
    assert (await invoice(api, "orphan"))["subtotal"] == before["subtotal"]


async def test_a_token_of_attempt_1_cannot_post_into_attempt_2(api, db) -> None:  # type: ignore[no-untyped-def]
    """M1: attempt 1's token posted usage into attempt 2 on the re-placed cluster (720 USD)."""
    await _world(api)
    first = await started(api, db, "moved", ago=60, maxPricePerGpuHour="100")
    await silence(db, first["cluster"])
    await _deaf_after(db, 30).reconcile_once()  # attempt 1 lost its site
    await _reconciler(db, 3600).reconcile_once()  # attempt 2 written on another cluster
    job = await _job_of(db, "moved")
    assert job.status["attempt"] == 2, job.status
    second = await claim(api, db, "moved", attempt=2, ago=60)
    assert second["worker_token"] != first["worker_token"] and second["cluster"] != first["cluster"]
    report = {"rank": 0, "site": second["site_index"], "step": 1, "tokens": 64, "gpuSeconds": 30.0}
    resp = await post_metrics(api, first["worker_token"], "moved", [report])
    assert resp.status == 401, await resp.text()  # revoked with its attempt
    async with db.session() as s:  # even were it not revoked, it belongs to attempt 1
        (await s.execute(select(Token).where(Token.subtask == first["uid"]))).scalar_one().revoked = False
    resp = await post_metrics(api, first["worker_token"], "moved", [report])
    assert resp.status == 403 and "attempt 1" in await resp.text(), await resp.text()
    resp = await post_metrics(api, second["worker_token"], "moved", [report])
    assert resp.status == 200, await resp.text()


async def test_worker_tokens_are_rate_limited_like_any_other(api, db) -> None:  # type: ignore[no-untyped-def]
    """M2: worker tokens skipped the rate limit."""
    from cpn.api.middleware import RATE
    from layers.orchestration.identity.ratelimit import limiter_for

    await _world(api)
    contract = await started(api, db, "busy", ago=30)
    api.client.app[RATE].__dict__.update(limiter_for(db, 1).__dict__)  # this server's limiter: 1 a minute
    codes = [(await post_metrics(api, contract["worker_token"], "busy",
                                 [{"rank": 0, "site": contract["site_index"], "step": i, "tokens": i}])).status
             for i in range(1, 4)]
    assert 429 in codes and codes[0] == 200, codes
