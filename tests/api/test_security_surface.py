"""Issue 35's small API-surface findings: capacity bounds (L3), security headers (L4), one message for any
unusable token (L5)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import update

from layers.orchestration.identity.models import Token
from layers.orchestration.identity.tokens import UNUSABLE
from tests.api.test_resource import WORLD_A, apply
from tests.conftest import make_token


async def test_a_heartbeat_past_any_cluster_is_a_422_naming_the_field(api) -> None:  # type: ignore[no-untyped-def]
    assert (await apply(api, "prov-a", WORLD_A)).status == 200
    for body, field in (({"capacityGpus": 1e23, "allocatableGpus": 1}, "capacityGpus"),
                        ({"allocatableGpus": 10**12}, "allocatableGpus")):
        r = await api.client.post("/api/v1/clusters/fra-h100/heartbeat", json=body, headers=api.auth("prov-a"))
        got = await r.json()
        assert r.status == 422 and field in str(got["error"]), got


async def test_the_portal_and_the_api_send_security_headers(api) -> None:  # type: ignore[no-untyped-def]
    for path, who in (("/", None), ("/ui", None), ("/api/v1/whoami", "alice"), ("/api/v1/nope", "alice"),
                      ("/healthz", None)):
        r = await api.client.get(path, headers=api.auth(who) if who else {})
        assert r.headers["X-Frame-Options"] == "DENY", path
        assert r.headers["X-Content-Type-Options"] == "nosniff", path
        csp = r.headers["Content-Security-Policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp, path


async def test_unknown_revoked_expired_and_malformed_tokens_read_alike(api, db) -> None:  # type: ignore[no-untyped-def]
    revoked, expired = await make_token(db, "rita", "user"), await make_token(db, "ed", "user")
    async with db.session() as s:
        await s.execute(update(Token).where(Token.lookup == revoked.split("_")[1]).values(revoked=True))
        await s.execute(update(Token).where(Token.lookup == expired.split("_")[1])
                        .values(expires_at=datetime.now(UTC) - timedelta(hours=1)))
        await s.commit()
    alice = api.tokens["alice"]
    messages = set()
    for token in (revoked, expired, "cpn_0123456789abcdef_nope", "nonsense", alice[:-3] + "xyz"):
        r = await api.client.get("/api/v1/whoami", headers={"Authorization": f"Bearer {token}"})
        assert r.status == 401, token
        messages.add((await r.json())["error"]["message"])
    assert messages == {UNUSABLE}


async def test_an_unknown_token_id_costs_the_same_kdf_as_a_wrong_secret(api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Refused before the KDF, an unknown id answered in a fraction of a wrong secret's time: the timing told
    which token ids exist (issue 35)."""
    from layers.orchestration.identity import tokens

    verified: list[str] = []
    hasher = tokens._HASHER

    class Counting:
        def verify(self, hashed: str, secret: str) -> bool:
            verified.append(secret)
            return hasher.verify(hashed, secret)

    monkeypatch.setattr(tokens, "_HASHER", Counting())
    alice = api.tokens["alice"]
    for token in ("cpn_0123456789abcdef_guess-one", f"cpn_{alice.split('_')[1]}_guess-two"):
        r = await api.client.get("/api/v1/whoami", headers={"Authorization": f"Bearer {token}"})
        assert r.status == 401 and (await r.json())["error"]["message"] == UNUSABLE
    assert verified == ["guess-one", "guess-two"]  # both ran the KDF


async def test_calibrations_show_only_the_callers_own_workloads(api, db) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import select

    from layers.orchestration.identity.models import Account
    from layers.orchestration.lifecycle.models import CalibrationRow
    from layers.service.models import JobRow

    digest = "sha256:" + "ab" * 32
    async with db.session() as s:
        alice = (await s.execute(select(Account.id).where(Account.name == "alice"))).scalar_one()
        s.add(JobRow(name="alice/mine", owner_id=alice, spec={"code": {"digest": digest}}, labels={}, status={}))
        for workload in ("lm", "code:" + "ab" * 8, "code:" + "cd" * 8):
            s.add(CalibrationRow(gpu_model="H100", strategy="ddp", workload=workload, provider="", step_factor=1.0,
                                 startup_seconds=1.0, samples=1, evidence=1.0))
    seen = {}
    for who in ("alice", "bob", "admin"):
        r = await api.client.get("/api/v1/calibrations", headers=api.auth(who))
        assert r.status == 200
        seen[who] = sorted(i["workload"] for i in (await r.json())["items"])
    assert seen["alice"] == ["code:" + "ab" * 8, "lm"]
    assert seen["bob"] == ["lm"]
    assert seen["admin"] == ["code:" + "ab" * 8, "code:" + "cd" * 8, "lm"]


async def test_metrics_need_an_admin_token_unless_the_server_opts_in(api, aiohttp_client, settings, db) -> None:  # type: ignore[no-untyped-def]
    from cpn.api.app import create_app

    assert (await api.client.get("/metrics")).status == 401
    assert (await api.client.get("/metrics", headers=api.auth("alice"))).status == 403
    assert (await api.client.get("/metrics", headers=api.auth("prov-a"))).status == 403
    r = await api.client.get("/metrics", headers=api.auth("admin"))
    assert r.status == 200 and "cpn_http_requests_total" in await r.text()
    public = await aiohttp_client(create_app(settings.model_copy(update={"metrics_public": True}), db, migrate=False))
    assert (await public.get("/metrics")).status == 200
