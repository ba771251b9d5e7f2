"""A burst of submissions (issue 13): concurrent quotes that find the process's catalogue copy out of
date load it once between them, every write that changes a quote (a price, a link) still shows on the
next quote, and each submission's audit row is written once, by its own INSERT where it can be."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from sqlalchemy import event, select

from layers.control import capacity as control_capacity
from layers.orchestration.identity.models import AuditRecord
from layers.resource import capacity
from layers.service.jobs import JobStore
from layers.service.schemas import TrainingJobManifest, TrainingJobSpec
from tests.api.test_jobs import job, quotes, register_world, submit, world
from tests.api.test_resource import apply

BURST = 12  # concurrent submissions: fewer than the database gate's slots on either database


def _forget_copies(db) -> None:  # noqa: ANN001
    """This process's catalogue copy and offer set of the test's database, as a fresh server has none."""
    where = str(db.engine.url)
    capacity._catalogues.pop(where, None)
    control_capacity._markets.pop(where, None)


class _Loads:
    """Counts the statements that read the catalogue's rows (clusters joined to sites)."""

    def __init__(self, db) -> None:  # noqa: ANN001
        self.engine, self.count = db.engine.sync_engine, 0

    def _seen(self, conn, cursor, statement: str, *args: Any) -> None:  # noqa: ANN001
        self.count += "FROM clusters JOIN sites" in " ".join(statement.split())

    def __enter__(self) -> _Loads:
        event.listen(self.engine, "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._seen)


async def _burst(api, prefix: str) -> None:  # noqa: ANN001
    answers = await asyncio.gather(*[submit(api, job(f"{prefix}-{i}"), key=f"{prefix}-{i}") for i in range(BURST)])
    assert [a.status for a in answers] == [201] * BURST, [await a.text() for a in answers]


async def test_a_burst_on_a_cold_copy_loads_the_catalogue_once(api, db) -> None:
    await register_world(api)
    _forget_copies(db)
    with _Loads(db) as loads:
        await _burst(api, "cold")
    assert loads.count == 1  # one load for the whole burst, not one per request in flight

    # a new price is a new stamp: the next burst loads once more, and its quotes carry the new price
    a, _ = world()
    a[3]["spec"]["nodePools"][0]["pricePerGpuHour"] = "2.20"
    assert (await apply(api, "prov-a", [a[3]])).status == 200
    with _Loads(db) as loads:
        await _burst(api, "repriced")
    assert loads.count == 1
    spec = {"gpus": {"min": 8, "max": 8}, "strategy": "ddp", "sites": {"min": 1, "max": 1},
            "placement": {"sites": ["ams-1"]}}
    assert (await submit(api, job("on-ams", **spec))).status == 201
    prices = {float(line["unitPrice"]) for q in await quotes(api, "on-ams") for line in q["price"]["lines"]
              if line["item"] == "gpu-hours"}
    assert prices == {2.2}

    with _Loads(db) as loads:  # nothing written since: the copy serves without a load
        await _burst(api, "warm")
    assert loads.count == 0


async def test_a_changed_link_shows_on_the_next_offer_set(api, db) -> None:
    await register_world(api)

    async def links() -> dict[str, tuple[float, str]]:
        async with db.session() as s:
            market = await control_capacity.offer_set(s, timedelta(seconds=60))
        return {ln.name: (ln.bandwidth_gbps, ln.price_per_gb) for ln in market.links}

    assert (await links())["fra-ams"] == (10.0, "0.02")
    a, _ = world()
    a[4]["spec"].update(bandwidthGbps=40, pricePerGB="0.05")
    assert (await apply(api, "prov-a", [a[4]])).status == 200
    assert (await links())["fra-ams"] == (40.0, "0.05")


async def test_waiters_load_by_themselves_when_the_shared_load_fails(monkeypatch) -> None:
    """A request that was loading for the others fails (or is cancelled): the waiters do not fail with
    it nor wait forever; each loads on its own session."""
    calls: list[str] = []
    started = asyncio.Event()

    async def load(session: Any, stamp: tuple[Any, ...]) -> Any:
        calls.append(session)
        if session == "first":
            started.set()
            await asyncio.sleep(0.01)
            raise ConnectionError("lost")
        return capacity._Catalogue(stamp, (), ())

    monkeypatch.setattr(capacity, "_load", load)
    monkeypatch.setattr(capacity, "_catalogues", {})
    stamp = (("c", 0, None, 0),)
    first = asyncio.create_task(capacity._load_once("first", "db://x", stamp))  # type: ignore[arg-type]
    await started.wait()
    second = asyncio.create_task(capacity._load_once("second", "db://x", stamp))  # type: ignore[arg-type]
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert isinstance(results[0], ConnectionError)
    assert isinstance(results[1], capacity._Catalogue) and results[1].stamp == stamp
    assert calls == ["first", "second"] and capacity._loading == {}


async def _audit_rows(db) -> list[tuple[str, int, str]]:  # noqa: ANN001
    async with db.session() as s:
        rows = (await s.execute(select(AuditRecord).where(AuditRecord.path == "/api/v1/jobs")
                                .order_by(AuditRecord.at))).scalars().all()
    return [(r.account_name, r.status, r.result) for r in rows]


async def test_every_submission_has_one_audit_row_whichever_statement_wrote_it(api, db) -> None:
    """On PostgreSQL a created job's audit row is written by the submission's own INSERT (one round trip
    less); a retry, a refusal and SQLite's path are audited by the middleware — one row each, as before."""
    await register_world(api)
    assert (await submit(api, job("audited"), key="a-1")).status == 201
    assert (await submit(api, job("audited"), key="a-1")).status == 200  # the same Idempotency-Key
    assert (await submit(api, job("audited"))).status == 409  # the name is taken
    assert await _audit_rows(db) == [("alice", 201, "ok"), ("alice", 200, "ok"), ("alice", 409, "already_exists")]


async def test_an_answer_that_fails_after_the_carried_row_is_audited_as_it_ended(api, db, monkeypatch) -> None:
    await register_world(api)

    def broken(*args: Any) -> Any:
        raise RuntimeError("the manifest could not be built")

    monkeypatch.setattr(JobStore, "to_manifest", broken)
    assert (await submit(api, job("half"))).status == 500
    # PostgreSQL: the job and its carried 201 row were written before the failure, then the middleware's 500
    assert await _audit_rows(db) == ([] if db.is_sqlite else [("alice", 201, "ok")]) + [("alice", 500, "internal")]


async def test_a_submission_validates_its_manifest_once(api, monkeypatch) -> None:
    """The code-bundle check's parse is the submission's parse, and the quotes are planned on that spec
    (job.spec is its dump) instead of a third validation."""
    await register_world(api)
    counts = {TrainingJobManifest: 0, TrainingJobSpec: 0}
    for model in counts:
        def counted(cls, *args: Any, _original=model.model_validate.__func__, **kwargs: Any) -> Any:  # noqa: ANN001
            counts[cls] += 1
            return _original(cls, *args, **kwargs)

        monkeypatch.setattr(model, "model_validate", classmethod(counted))
    assert (await submit(api, job("once"))).status == 201
    assert counts == {TrainingJobManifest: 1, TrainingJobSpec: 0}
