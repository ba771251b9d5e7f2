"""Job routes beyond CRUD: quotes, accept, reservations, invoices, events."""

from __future__ import annotations

from aiohttp import web

from cpn.api import state
from cpn.api.bodies import json_response, read_model
from cpn.api.middleware import principal_of
from cpn.api.openapi import RouteDoc
from cpn.api.routes import add
from cpn.core.db import as_utc
from cpn.core.store import split_key
from layers.control import leases
from layers.orchestration.events import list_events
from layers.orchestration.jobs.workflow import Timeouts, accept_quote
from layers.orchestration.quotas import usage as quotas
from layers.service import billing
from layers.service import quotes as quotes_mod
from layers.service.jobs import JobStore, display_name, job_key, load_job, owned_keys
from layers.service.schemas import AcceptRequest, QuotePublic, TrainingJobManifest

TIMEOUTS = web.AppKey("timeouts", Timeouts)


async def get_quotes(request: web.Request) -> web.Response:
    """The job's quotes, each open one with how it stands against the quotas binding its owner: in the common
    case one statement (the quotes, and whether any quota binds), and the quotas' usage only when one does."""
    db, principal, name = request.app[state.DB], principal_of(request), request.match_info["name"]
    owner = split_key(JobStore().key(principal, name))[0] or ""
    found = await quotes_mod.job_quotes_and(db, principal, name, quotas.BINDS, {quotas.BINDS_ACCOUNT: owner})
    if found is not None:
        items, bound = found
        if bound:
            async with db.session() as s:
                await quotas.annotate(s, owner, items)
    else:  # not the common case (see job_quotes_read_once): the full lookup
        async with db.session() as s:
            items = await quotes_mod.job_quotes(s, principal, name)
            await quotas.annotate(s, split_key((await load_job(s, principal, name)).name)[0] or "", items)
    return json_response({"apiVersion": "cpn/v1", "kind": "List", "items": items})


async def post_accept(request: web.Request) -> web.Response:
    body = await read_model(request, AcceptRequest)
    principal = principal_of(request)
    name = request.match_info["name"]
    result = await accept_quote(request.app[state.DB], principal, name, body.quote, request.app[TIMEOUTS])
    manifest = JobStore().to_manifest(principal, result.job)
    manifest["status"]["leases"] = [{"cluster": x.cluster, "gpus": x.gpus, "id": x.id} for x in result.leases]
    return json_response(manifest)


async def get_reservations(request: web.Request) -> web.Response:
    principal = principal_of(request)
    async with request.app[state.DB].session() as s:
        rows = await leases.visible(s, principal, job=await job_key(s, principal, request.query.get("job")),
                                    namespace=request.query.get("namespace") or None)
    items = [{"apiVersion": "cpn/v1", "kind": "Reservation",
              "metadata": {"name": r.id[:8], "uid": r.id, "creationTimestamp": as_utc(r.created_at).isoformat()},
              "spec": {"job": r.job, "subtask": r.subtask, "cluster": r.cluster, "gpus": r.gpus,
                       "contract": r.contract_id},
              "status": {"state": r.state, "expiresAt": as_utc(r.expires_at).isoformat() if r.expires_at else None,
                         "reason": r.reason}} for r in rows]
    return json_response({"apiVersion": "cpn/v1", "kind": "List", "items": items})


async def get_invoices(request: web.Request) -> web.Response:
    principal = principal_of(request)
    async with request.app[state.DB].session() as s:
        items = await billing.invoice_list(s, principal, job=await job_key(s, principal, request.query.get("job")),
                                           namespace=request.query.get("namespace") or None)
    return json_response({"apiVersion": "cpn/v1", "kind": "List", "items": items})


async def get_events(request: web.Request) -> web.Response:
    principal = principal_of(request)
    job = request.query.get("job")
    async with request.app[state.DB].session() as s:
        if job:
            jobs: list[str] | None = [(await load_job(s, principal, job)).name]
        elif principal.is_admin:
            jobs = None
        else:
            jobs = await owned_keys(s, principal)
        limit = request.query.get("limit")
        items = await list_events(s, jobs, **({"limit": int(limit)} if limit else {}),
                                  namespace=request.query.get("namespace") or None)
    for item in items:  # a name of its own (not its place in this listing, which ?limit moves)
        uid = item.pop("uid")
        item["metadata"] = {"name": f"{display_name(item['job'])}.{uid[:8]}", "uid": uid}
    return json_response({"apiVersion": "cpn/v1", "kind": "List", "items": items})


def setup(app: web.Application) -> None:
    app[TIMEOUTS] = Timeouts.of(app[state.SETTINGS])
    add(app, get_quotes, RouteDoc("GET", "/api/v1/jobs/{name}/quotes", "Offers for a job", "TrainingJob",
                                  response=QuotePublic, list_response=True, params=("name",)))
    add(app, post_accept, RouteDoc("POST", "/api/v1/jobs/{name}/accept", "Accept a quote: contract + leases",
                                   "TrainingJob", request=AcceptRequest, response=TrainingJobManifest,
                                   params=("name",)))
    add(app, get_reservations, RouteDoc("GET", "/api/v1/reservations", "GPU leases", "Reservation",
                                        query=("job", "namespace")))
    add(app, get_invoices, RouteDoc("GET", "/api/v1/invoices", "Invoices (users) and payouts (providers)",
                                    "Invoice", query=("job", "namespace")))
    add(app, get_events, RouteDoc("GET", "/api/v1/events", "Job events (the latest `limit`, in time order)", "Event",
                                  query=("job", "limit", "namespace")))
