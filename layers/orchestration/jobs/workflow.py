"""Submit, quote and accept: the orchestration of the service and control layers for one job."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import Table, and_, bindparam, func, insert, literal, or_, select
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.db import Base, Database, new_uid
from cpn.core.principal import Principal
from cpn.core.settings import Settings
from cpn.core.store import split_key
from layers.control import capacity
from layers.orchestration.events import record_event
from layers.orchestration.identity.audit import Pending
from layers.orchestration.jobs import data, profile
from layers.orchestration.jobs.requirements import objective, planner_inputs_of, prediction_dict, requirements
from layers.orchestration.lifecycle import learning
from layers.orchestration.lifecycle.plan import attempt_plan, budget_note, memory_of
from layers.orchestration.planning import placement
from layers.orchestration.quotas import usage as quotas
from layers.resource.capacity import inventory
from layers.service import pricing
from layers.service import quotes as quotes_mod
from layers.service.contracts import Accepted, QuoteUnavailable, accept
from layers.service.jobs import DRAFT_PHASES, JobStore, load_job, set_phase
from layers.service.models import JobRow, QuoteRow
from layers.service.schemas import TrainingJobManifest, TrainingJobSpec
from layers.service.status import ProfileStatus


@dataclass(frozen=True)
class Timeouts:
    heartbeat: timedelta
    quote_ttl: timedelta
    lease_ttl: timedelta

    @classmethod
    def of(cls, settings: Settings) -> Timeouts:
        return cls(heartbeat=timedelta(seconds=settings.heartbeat_timeout_seconds),
                   quote_ttl=timedelta(seconds=settings.quote_ttl_seconds),
                   lease_ttl=timedelta(seconds=settings.lease_ttl_seconds))


CREATED = 201  # the answer to a submission that created its job (what its carried audit row says)
EXACT_MAX_OFFERS = 12  # beyond this the MILP takes seconds; the heuristic stays within a few % (bench scheduler)


def solver_for(offers: int) -> str:
    """The exact MILP for small catalogues, the heuristic where a request must answer quickly."""
    return "exact" if offers <= EXACT_MAX_OFFERS else "heuristic"


async def submit(session: AsyncSession, principal: Principal, body: Any, idempotency_key: str | None,
                 t: Timeouts, *, audit: Pending | None = None) -> tuple[dict[str, Any], bool]:
    """Create a job and quote it. A retried submission with the same Idempotency-Key returns the
    same job (and False: not created). `body`: the manifest, or the store's parse of it (a caller that
    checked it already). `audit`: the request's audit row, written by the submission's one INSERT
    statement where there is one (PostgreSQL) as a created (201) answer."""
    store = JobStore()
    obj = body if isinstance(body, TrainingJobManifest) else store.parse(body)
    key = store.new_key(principal, obj)
    spec: TrainingJobSpec = obj.spec  # type: ignore[attr-defined]
    now = datetime.now(UTC)
    lookup = {"owner": principal.account_id, "key": idempotency_key, "name": key}
    # PostgreSQL, no profile run: two reads and one INSERT statement, each its own transaction (no
    # BEGIN/COMMIT round trips); the INSERT, that writes everything, is atomic by itself
    one_statement = _writes_in_one_statement(session) and not spec.profile and not session.in_transaction()
    if one_statement:
        await session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
    # one round trip: the market (see price_options) and how many jobs hold this Idempotency-Key or
    # the name; those jobs are read only when there are any (a retry, a name already taken)
    market = await _market(session, spec, t, now, (principal.account_id, split_key(key)[0] or ""), lookup)
    found = [] if not _extra(market)[_JOBS_TAG][1] else (await session.execute(_BY_IDEMPOTENCY_KEY_OR_NAME,
                                                                             lookup)).scalars().all()
    earlier = next((j for j in found if idempotency_key and j.owner_id == principal.account_id
                    and j.idempotency_key == idempotency_key), None)
    if earlier is not None:
        return store.to_manifest(principal, earlier), False
    # The job, its events and its quotes are written together by one flush at the end (an INSERT per
    # table, many rows each) instead of an INSERT, a re-read and UPDATEs along the way.
    job: JobRow = await store.create_row(session, principal, obj, flush=False,  # type: ignore[assignment]
                                         existing=next((j for j in found if j.name == key), None))
    job.id = new_uid()  # the quotes name it before it is written
    job.idempotency_key = idempotency_key
    await record_event(session, job.name, "Normal", "Submitted", f"submitted by {principal.name}")
    if spec.profile:  # quoted once its own steps are timed (profile.py)
        await start_profile(session, job, t)
        await session.flush()
        return store.to_manifest(principal, job), True
    with session.no_autoflush:
        await requote(session, job, t, now, fresh=True, market=market, spec=spec)
    if one_statement:
        if audit is not None:
            audit.ride_along(session, CREATED)
        await _insert_new(session)
        if audit is not None:
            audit.written = CREATED
    else:
        await session.flush()
    return store.to_manifest(principal, job), True


def _writes_in_one_statement(session: AsyncSession) -> bool:
    """Whether the database runs INSERTs as data-modifying WITHs of one statement (SQLite does not)."""
    return session.get_bind().dialect.name == "postgresql"


async def _insert_new(session: AsyncSession) -> None:
    """Write the session's new rows (a submission's job, events and quotes) in one statement (see
    _inserts_of): one round trip where a flush takes one per table (and BEGIN/COMMIT around them).
    Column defaults are set on the rows as a flush would set them; the rows leave the session."""
    values: dict[Table, list[dict[str, Any]]] = {}
    for row in list(session.new):
        mapper = sa_inspect(row).mapper
        fields = {}
        for prop in mapper.column_attrs:
            column = prop.columns[0]
            value = getattr(row, prop.key)
            if value is None and column.default is not None:
                value = column.default.arg(None) if column.default.is_callable else column.default.arg
                setattr(row, prop.key, value)
            fields[column.key] = value
        values.setdefault(mapper.local_table, []).append(fields)
        session.expunge(row)
    if values:
        shape = tuple(sorted(((table, len(rows), tuple(rows[0])) for table, rows in values.items()),
                             key=lambda part: part[0].name))
        params = {f"{table.name}_{i}_{key}": value for table, rows in values.items()
                  for i, row in enumerate(rows) for key, value in row.items()}
        await session.execute(_inserts_of(shape), params)


@functools.lru_cache(maxsize=64)  # one statement object per shape, so SQLAlchemy compiles it once
def _inserts_of(shape: tuple[tuple[Table, int, tuple[str, ...]], ...]) -> Any:
    """The INSERT of `shape` ((table, rows, column keys) …) as one statement: an INSERT per row (a
    multi-row VALUES is never in SQLAlchemy's compiled cache), all but the last as data-modifying WITHs
    of it, referenced tables first. Values are parameters named table_row_column."""
    order = {table: i for i, table in enumerate(Base.metadata.sorted_tables)}
    inserts = [insert(table).values({key: bindparam(f"{table.name}_{i}_{key}", type_=table.c[key].type)
                                     for key in keys}).cte(f"new_{table.name}_{i}")
               for table, rows, keys in sorted(shape, key=lambda part: order[part[0]]) for i in range(rows)]
    return inserts[-1].element.add_cte(*inserts[:-1])


_BY_IDEMPOTENCY_KEY_OR_NAME = select(JobRow).where(or_(  # built once
    and_(JobRow.owner_id == bindparam("owner"), JobRow.idempotency_key == bindparam("key")),
    JobRow.name == bindparam("name")))
_JOBS_TAG = "jobs"
# _BY_IDEMPOTENCY_KEY_OR_NAME counted, in the shape of the catalogue's stamp rows (capacity.offer_set)
_JOBS_PROBE = select(literal(_JOBS_TAG), func.count(), func.max(JobRow.updated_at), literal(0)).where(
    _BY_IDEMPOTENCY_KEY_OR_NAME.whereclause)


async def _market(session: AsyncSession, spec: TrainingJobSpec, t: Timeouts, now: datetime,
                  owner: tuple[str, str] | None, lookup: dict[str, Any] | None = None) -> capacity.OfferSet:
    """The offer set, in one round trip with the calibrations' stamp, whether the owner holds a
    Dataset named spec.dataset (`owner`: account id, namespace) and how many jobs match `lookup`
    (_BY_IDEMPOTENCY_KEY_OR_NAME's values)."""
    also: tuple[Any, ...] = (learning.stamp(),)
    params: dict[str, Any] = {}
    if owner is not None:
        also, params = (*also, data.probe()), data.probe_params(*owner, spec.dataset)
    if lookup is not None:
        also, params = (*also, _JOBS_PROBE), {**params, **lookup}
    return await capacity.offer_set(session, t.heartbeat, now, also=also, params=params or None)


def _extra(market: capacity.OfferSet) -> dict[str, Any]:
    return {r[0]: r for r in market.extra}


async def requote(session: AsyncSession, job: JobRow, t: Timeouts, now: datetime | None = None, *,
                  fresh: bool = False, market: capacity.OfferSet | None = None,
                  spec: TrainingJobSpec | None = None) -> list[dict[str, Any]]:
    """Plan the job against live capacity and store fresh quotes; the job becomes Quoted. `fresh`: the
    job is being created in this transaction (it has no quotes to supersede; the caller flushes);
    `market`: the offer set already read for it at `now` (see _market); `spec`: the job's spec as the
    submission parsed it (job.spec is its dump), instead of validating job.spec again."""
    now = now or datetime.now(UTC)
    spec = spec or TrainingJobSpec.model_validate(job.spec)
    saved = await price_options(session, spec, t, now, job_id=job.id,
                                owner=(job.owner_id, split_key(job.name)[0] or ""), profiled=profile.current(job, spec),
                                market=market)
    if not fresh:
        await quotes_mod.supersede_open(session, job)
    session.add_all(saved)
    if not fresh:
        await session.flush()
    if job.phase != "Quoted":
        previous = set_phase(job, "Quoted", "Quoted", f"{len(saved)} quote(s) offered", now)
        await record_event(session, job.name, "Normal", "Quoted",
                           (f"{previous} → Quoted: " if previous else "quoted: ") + ", ".join(f"{q.label} {q.total:.2f} {q.currency}" for q in saved))
    return [quotes_mod.public(q) for q in saved]


# Quotes are planned on threads of their own: a large job's planning (seconds at spec.model.layers near
# its cap) must not hold the event loop, where every other user's requests and the sites' heartbeats
# wait, nor the default pool, where token checks run. Two at a time; more queue.
PLANNER_THREADS = 2
_PLANNER = ThreadPoolExecutor(PLANNER_THREADS, thread_name_prefix="cpn-planner")


async def price_options(session: AsyncSession, spec: TrainingJobSpec, t: Timeouts, now: datetime,
                        job_id: str | None = None, owner: tuple[str, str] | None = None,
                        profiled: ProfileStatus | None = None, market: capacity.OfferSet | None = None
                        ) -> list[QuoteRow]:
    """Cheapest / fastest / balanced plans against live capacity, priced; the rows are not stored.
    `owner` (account id, namespace) resolves spec.dataset; a measured `profiled` run (spec.profile)
    prices the compute from the job's own steps, and the quotes' basis says so. `market`: the offer
    set already read by `_market` with the same `owner` at `now`."""
    # one round trip: the catalogue's stamp, the active leases, the calibrations' stamp and whether the
    # owner holds a Dataset named spec.dataset
    market = market or await _market(session, spec, t, now, owner)
    extra = _extra(market)
    need = await data.need_probed(session, *owner, spec.dataset, extra[data.PROBE_TAG]) if owner is not None else None
    learned = await learning.load_at(session, extra[learning.STAMP_TAG])  # what finished runs taught
    req = replace(requirements(spec, now), learned=learned, data=need, profiled=profile.profiled(profiled))
    # the inputs, the plans and their pricing are pure computation: all of it on a planner thread (the
    # first quote on a large world held the loop for seconds when only the planning ran there)
    def plan_and_price() -> tuple[list[QuoteRow], list[str]]:
        offers, wan = planner_inputs_of(market, spec.currency)
        links = market.links
        plans = placement.quote_options(req, offers, wan, objective(spec), solver=solver_for(len(offers)))
        region_of, sellers, link_prices, link_owners = pricing_inputs(market)
        rows, refused = [], []
        for label, plan in plans.items():
            pred = plan.prediction
            lines = pricing.price_lines(pred.gpu_seconds_by_cluster, pred.egress_bytes_by_link, sellers, link_prices,
                                        link_owners)
            lines += pricing.data_transfer_lines(data_transfers(plan), sellers)
            placement_lines = [{"cluster": a.cluster, "site": a.site, "gpus": a.gpus, "gpuModel": a.gpu_model,
                                "region": region_of[a.cluster], **({} if a.stage is None else {"stage": a.stage}),
                                **({} if a.replica is None else {"replica": a.replica})}
                               for a in plan.assignments]
            prediction = prediction_dict(pred)
            reason, train = _unrunnable(spec, plan.strategy, placement_lines, plan.ring, links, memory_of(prediction))
            if reason is not None:  # never offer what the workers would refuse
                refused.append(f"{label} ({plan.strategy} on {'+'.join(str(a.gpus) for a in plan.assignments)}"
                               f" GPUs): {reason}")
                continue
            trains = {} if train is None else {"trains": {"tokens": train["tokens"],
                                                          "globalBatchTokens": train["global_batch_tokens"],
                                                          "note": budget_note(spec, train)}}
            basis = {"basis": "modelled"} if req.profiled is None or profiled is None else {
                "basis": "profiled", "profile": profile.figure(profiled, pred.steps, pred.step_seconds)}
            rows.append(quotes_mod.new_quote(
                job_id, label, placement=placement_lines, strategy=plan.strategy, ring=plan.ring,
                prediction={**prediction, **trains, **basis, "dataSeconds": pred.data_seconds,
                            "dataTransfer": data.lines_info(pred.data_moves)}, predicted_seconds=pred.total_seconds, wan_gb=pred.wan_bytes / 1e9,
                lines=lines, total=pricing.total(lines), currency=spec.currency, ttl=t.quote_ttl, now=now))
        return rows, refused

    rows, refused = await asyncio.get_running_loop().run_in_executor(_PLANNER, plan_and_price)
    if not rows and refused:
        raise errors.Infeasible("no placement can run: " + "; ".join(refused), field=_field_of(refused[0]))
    return quotes_mod.true_labels(rows)


def pricing_inputs(market: capacity.OfferSet) -> tuple[dict[str, str], dict[str, pricing.Seller],
                                                         dict[frozenset[str], Decimal], dict[frozenset[str], str]]:
    """(region of each offer, its seller, price and owner of each link): once per offer set (read-only)."""
    held = market.derived.get("pricing_inputs")
    if held is None:
        region_of = {o.offer: o.region for o in market.offers}
        sellers = {o.offer: pricing.Seller(provider=o.provider, provider_account_id=o.owner_id, site=o.site,
                                           price_per_gpu_hour=o.price_per_gpu_hour, currency=o.currency)
                   for o in market.offers}
        link_prices = {frozenset((ln.a, ln.b)): Decimal(ln.price_per_gb) for ln in market.links}
        link_owners = {frozenset((ln.a, ln.b)): ln.owner_id for ln in market.links}
        held = market.derived["pricing_inputs"] = (region_of, sellers, link_prices, link_owners)
    return held


async def start_profile(session: AsyncSession, job: JobRow, t: Timeouts) -> None:
    """spec.profile: price the job as modelled to find where to time it, then start its profile run
    (layers/orchestration/jobs/profile.py); the reconciler quotes it from the measured steps."""
    spec = TrainingJobSpec.model_validate(job.spec)
    rows = await price_options(session, spec, t, datetime.now(UTC), owner=(job.owner_id, split_key(job.name)[0] or ""))
    await profile.start(session, job, spec, rows, heartbeat_timeout=t.heartbeat, lease_ttl=t.lease_ttl)


def data_transfers(plan: Any) -> list[tuple[str, float, Decimal]]:
    """(receiving cluster, GB, price per GB) of each dataset copy: a site's copy goes to its first cluster."""
    first = {}
    for a in plan.assignments:
        first.setdefault(a.site, a.cluster)
    return [(first[site], m.gb, m.price_per_gb) for site, m in plan.prediction.data_moves.items()]


def _unrunnable(spec: TrainingJobSpec, strategy: str, placement: list[dict[str, Any]], ring: list[str],
                links: list[Any], memory: dict[str, str] | None = None) -> tuple[str | None, dict[str, Any] | None]:
    """(why the workers would refuse this plan, or None; the TrainConfig they would run)."""
    try:
        _, train = attempt_plan(spec, strategy, placement, ring, links, memory=memory)
    except ValueError as exc:
        return (str(exc).splitlines()[0] if str(exc) else type(exc).__name__), None
    return None, train


async def preview(session: AsyncSession, principal: Principal, body: Any, t: Timeouts) -> dict[str, Any]:
    """A dry run of `submit`: the job as it would be created and the quotes it would get; nothing is
    stored. A name taken by anything but this user's own not-yet-accepted draft is refused as `submit`
    would; for a draft, `status.draft` says that submitting again refreshes its quotes in place."""
    store = JobStore()
    obj = store.parse(body)
    store.authorize_write(principal, None)
    name = obj.metadata.name
    existing = await store.find(session, store.key(principal, name, store.own_namespace(principal, obj)))
    draft = existing is not None and existing.owner_id == principal.account_id and existing.phase in DRAFT_PHASES
    if existing is not None and not draft:
        raise errors.AlreadyExists(f"TrainingJob {name!r} already exists and is no longer a draft; pick "
                                   "another name", field="metadata.name")
    spec: TrainingJobSpec = obj.spec  # type: ignore[attr-defined]
    now = datetime.now(UTC)
    rows = await price_options(session, spec, t, now, owner=(principal.account_id, principal.name))
    quotes = quotes_mod.views([quotes_mod.public(q) for q in rows], None, now=now)
    await quotas.annotate(session, principal.name, quotes, now)  # how each stands against the caller's quotas
    wire = obj.model_dump(mode="json", by_alias=True, exclude_none=True)
    return {**wire, "status": {"phase": "Quoted", "dryRun": True, "draft": draft, "quotes": quotes}}


async def accept_quote(db: Database, principal: Principal, job_name: str, ref: str, t: Timeouts) -> Accepted:
    """Accept in one serialised transaction; if the quote is stale, re-quote in a second one and
    raise 409 carrying the fresh quotes."""
    try:
        async with db.serialized(), db.session() as session:
            result = await accept(session, principal, job_name, ref, heartbeat_timeout=t.heartbeat,
                                  lease_ttl=t.lease_ttl, admit=quotas.admit)
            await check_runnable(session, result, t)  # raising rolls the accept back: nothing is half-written
            await record_event(session, result.job.name, "Normal", "Reserved",
                               f"Quoted → Accepted → Reserved with quote {result.quote.label}: "
                               + ", ".join(f"{lease.gpus}×{lease.cluster}" for lease in result.leases))
            return result
    except QuoteUnavailable as exc:
        fresh: list[dict[str, Any]] = []
        try:
            async with db.serialized(), db.session() as session:
                job = await load_job(session, principal, job_name, lock=True)
                fresh = await requote(session, job, t)
        except errors.Infeasible as inner:
            exc.details = {"freshQuotes": [], "reason": inner.message}
            raise exc from inner
        exc.details = {"freshQuotes": fresh}
        exc.message += "; fresh quotes are offered (cpnctl get quotes " + job_name + ")"
        raise


async def check_runnable(session: AsyncSession, accepted: Accepted, t: Timeouts) -> None:
    """The accepted quote's first attempt, built and checked as the runtime would check it: a job its
    workers would refuse is a 422 here, not a failed worker later."""
    quote, job = accepted.quote, accepted.job
    _, links = await inventory(session, t.heartbeat)
    try:
        attempt_plan(TrainingJobSpec.model_validate(job.spec), quote.strategy, quote.placement, quote.ring, links,
                     memory=memory_of(quote.prediction))
    except ValueError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise errors.InvalidInput(f"the {quote.label} quote cannot run: {reason}", field=_field_of(reason)) from exc


def _field_of(reason: str) -> str:
    """The user's field a runtime refusal is about."""
    for word, field in (("model", "spec.model"), ("batch", "spec.globalBatchTokens"), ("seq_len", "spec.model"),
                        ("corpus", "spec.dataset"), ("tokens", "spec.tokens")):
        if word in reason:
            return field
    return "spec.strategy"
