"""The offer set a quote plans on is built once per market, and every write (or the clock) that changes
what a quote may offer shows on the next quote: a heartbeat, a price, a lease, a timed-out heartbeat,
a calibration. A submission's own writes go in a few statements."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import event, select, update

from layers.control.capacity import offer_set
from layers.control.models import LeaseRow
from layers.orchestration.jobs.requirements import planner_inputs_of
from layers.orchestration.lifecycle import learning
from layers.orchestration.lifecycle.models import CalibrationRow
from layers.resource.models import ClusterRow
from tests.api.test_jobs import job, quotes, register_world, submit, world
from tests.api.test_resource import apply

TIMEOUT = timedelta(seconds=60)


async def _offers(db, now: datetime | None = None):
    async with db.session() as s:
        market = await offer_set(s, TIMEOUT, now)
    return market, {o.offer: (o.free_gpus, str(o.price_per_gpu_hour)) for o in market.offers}


async def test_the_offer_set_is_shared_until_something_a_quote_sees_changes(api, db) -> None:
    await register_world(api)
    first, seen = await _offers(db)
    again, seen_again = await _offers(db)
    assert seen == seen_again and seen["fra-h100"] == (8, "2.50")
    assert again.offers is first.offers and again.derived is first.derived  # not rebuilt
    assert planner_inputs_of(again, "USD") is planner_inputs_of(first, "USD")

    # a heartbeat that moves the free GPUs
    resp = await api.client.post("/api/v1/clusters/fra-h100/heartbeat", headers=api.auth("prov-a"),
                                 json={"allocatableGpus": 5, "conditions": [{"type": "Ready", "status": "True"}]})
    assert resp.status == 200
    market, seen = await _offers(db)
    assert seen["fra-h100"] == (5, "2.50") and market.offers is not first.offers
    assert planner_inputs_of(market, "USD") is not planner_inputs_of(first, "USD")

    # a new price
    a, _ = world()
    a[2]["spec"]["nodePools"][0]["pricePerGpuHour"] = "3.10"
    assert (await apply(api, "prov-a", [a[2]])).status == 200
    assert (await _offers(db))[1]["fra-h100"] == (5, "3.10")

    # a lease held on a cluster, then released
    async with db.session() as s:
        row = (await s.execute(select(ClusterRow).where(ClusterRow.name == "ams-a100"))).scalar_one()
        s.add(LeaseRow(job="someone/j", subtask="s0", cluster_id=row.id, cluster="ams-a100", owner_id=row.owner_id,
                       gpus=6, state="active"))
    assert (await _offers(db))[1]["ams-a100"][0] == 2
    async with db.session() as s:
        await s.execute(update(LeaseRow).where(LeaseRow.cluster == "ams-a100").values(state="released"))
    assert (await _offers(db))[1]["ams-a100"][0] == 8

    # the clock alone: past the heartbeat timeout a cluster offers nothing, with nothing written
    later = datetime.now(UTC) + TIMEOUT + timedelta(seconds=5)
    assert set((await _offers(db, later))[1].values()) == {(0, "3.10"), (0, "1.10"), (0, "1.90")}
    assert (await _offers(db))[1]["ams-a100"][0] == 8  # and back at the present (an earlier `now`)


async def test_the_learned_calibrations_follow_every_write(api, db) -> None:
    async def learned():
        async with db.session() as s:
            market = await offer_set(s, TIMEOUT, also=(learning.stamp(),))
            return await learning.load_at(s, market.extra[0])

    assert (await learned()).lessons == ()
    async with db.session() as s:
        s.add(CalibrationRow(gpu_model="H100", strategy="ddp", workload="lm", step_factor=2.0, startup_seconds=30.0,
                             samples=1))
    assert [x.step_factor for x in (await learned()).lessons] == [2.0]
    async with db.session() as s:
        row = (await s.execute(select(CalibrationRow))).scalar_one()
        row.step_factor = 1.5
    assert [x.step_factor for x in (await learned()).lessons] == [1.5]


async def test_quotes_follow_a_price_change_between_two_submissions(api) -> None:
    await register_world(api)
    spec = {"gpus": {"min": 8, "max": 8}, "strategy": "ddp", "sites": {"min": 1, "max": 1},
            "placement": {"sites": ["ams-1"]}}
    assert (await submit(api, job("before", **spec))).status == 201
    a, _ = world()
    a[3]["spec"]["nodePools"][0]["pricePerGpuHour"] = "2.20"  # ams-a100 doubles its price
    assert (await apply(api, "prov-a", [a[3]])).status == 200
    assert (await submit(api, job("after", **spec))).status == 201
    for name, price in (("before", "1.1"), ("after", "2.2")):
        gpu_lines = [line for q in await quotes(api, name) for line in q["price"]["lines"]
                     if line["item"] == "gpu-hours"]
        assert gpu_lines and {(line["cluster"], float(line["unitPrice"])) for line in gpu_lines} == \
            {("ams-a100", float(price))}


async def test_a_submission_writes_its_job_events_and_quotes_in_few_statements(api, db) -> None:
    """The submission: one market round trip (catalogue stamp, leases, calibrations, the owner's Dataset
    of that name, how many jobs hold its Idempotency-Key or name), then its writes — on PostgreSQL one
    INSERT statement (the job, its events and the request's audit row as data-modifying WITHs of the
    quotes' INSERT) outside a transaction, on SQLite one INSERT each for the job, its events, its quotes; reading its quotes is one
    statement."""
    await register_world(api)
    assert (await submit(api, job("warm"))).status == 201  # the catalogue loaded once
    statements: list[str] = []
    full: list[str] = []  # the handler's writes, whole

    def count(conn, cursor, statement, *args) -> None:  # noqa: ANN001
        words = statement.split()
        if statement.startswith("WITH new_"):
            full.append(statement)
        statements.append(" ".join(words[:3]) if statement.startswith(("INSERT", "WITH")) else " ".join(words[:2]))

    event.listen(db.engine.sync_engine, "before_cursor_execute", count)
    try:
        assert (await submit(api, job("counted"), key="k-1")).status == 201
        posted = len(statements)
        items = await quotes(api, "counted")
    finally:
        event.remove(db.engine.sync_engine, "before_cursor_execute", count)
    handler = [s for s in statements[:posted] if not s.startswith(("INSERT INTO audit_records", "SELECT tokens",
                                                                   "WITH bucket"))  # middlewares'
               and "rate_buckets" not in s]
    writes = [s for s in handler if not s.startswith("SELECT ")]
    if db.is_sqlite:
        assert len(handler) <= 4 and len(writes) == 3 and all(s.startswith("INSERT") for s in writes), statements
    else:
        assert len(handler) == 2 and len(writes) == 1 and writes[0].startswith("WITH new_"), statements
        assert all(f"INSERT INTO {table} " in full[-1] for table in ("jobs", "events", "quotes", "audit_records")), \
            full[-1]
        # the request's audit row rides in that INSERT: no audit statement of its own, 3 statements in all
        assert len(statements[:posted]) == 3 and not any(s.startswith("INSERT INTO audit_records")
                                                         for s in statements[:posted]), statements
    read = [s for s in statements[posted:] if not s.startswith(("SELECT tokens", "WITH bucket"))]
    assert len(read) == 1 and read[0].startswith("SELECT"), statements
    assert {q["label"] for q in items} == {"cheapest", "fastest", "balanced"}
    events = (await (await api.client.get("/api/v1/events?job=counted", headers=api.auth("alice"))).json())["items"]
    assert [e["reason"] for e in events] == ["Submitted", "Quoted"]
    again = await submit(api, job("counted"), key="k-1")  # the same key: the same job, nothing new
    assert again.status in (200, 201) and (await again.json())["metadata"]["name"] == "counted"
    dup = await submit(api, job("counted"))
    assert dup.status == 409
    unknown = await submit(api, job("nodata", dataset="no-such-corpus"))  # the market read says: no such Dataset
    assert unknown.status == 422 and (await unknown.json())["error"]["field"] == "spec.dataset"
