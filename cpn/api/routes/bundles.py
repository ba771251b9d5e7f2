"""Code bundles (``spec.code``) and a job's final weights: thin handlers over
:mod:`layers.resource.bundles`. A user stores and reads only their own bundles; a worker token reads
only the bundle its job names and writes only its job's final weights."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from cpn.api import state
from cpn.api.bodies import json_response
from cpn.api.middleware import principal_of
from cpn.api.openapi import RouteDoc
from cpn.api.routes import add
from cpn.api.routes.lifecycle import BLOBS
from cpn.core import errors
from cpn.core.principal import Principal, Role
from layers.resource import bundles
from layers.service.jobs import load_job


def _owner(principal: Principal) -> str:
    if principal.role is Role.WORKER:
        raise errors.Forbidden("a worker token may not store bundles")
    return principal.account_id


async def _stream(request: web.Request, chunks: AsyncIterator[bytes], filename: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream",
                                           "Content-Disposition": f'attachment; filename="{filename}"'})
    await response.prepare(request)
    async for chunk in chunks:
        await response.write(chunk)
    await response.write_eof()
    return response


async def put_bundle(request: web.Request) -> web.Response:
    owner = _owner(principal_of(request))
    limit = request.app[state.SETTINGS].bundle_max_bytes
    if request.content_length is not None and request.content_length > limit:
        raise errors.PayloadTooLarge(f"bundle of {request.content_length:,} bytes is over the limit of {limit:,} "
                                     "bytes: leave large files out with .cpnignore (data belongs in spec.dataset)",
                                     field="body")
    result = await bundles.put(request.app[BLOBS], owner, request.match_info["sha256"],
                               request.content.iter_chunked(1 << 20), limit)
    return json_response(result, status=201 if result.pop("created") else 200)


async def get_bundle(request: web.Request) -> web.StreamResponse:
    principal = principal_of(request)
    digest = f"sha256:{bundles.hex_of(request.match_info['sha256'])}"
    owner = principal.account_id
    if principal.role is Role.WORKER:  # only the bundle its own job runs
        async with request.app[state.DB].session() as s:
            job = await load_job(s, principal, principal.job or "")
        if ((job.spec or {}).get("code") or {}).get("digest") != digest:
            raise errors.Forbidden("a worker token reads only its own job's bundle")
        owner = job.owner_id
    chunks = await bundles.open_bundle(request.app[BLOBS], owner, digest)
    return await _stream(request, chunks, f"{digest.removeprefix('sha256:')[:12]}.tar.gz")


async def head_bundle(request: web.Request) -> web.Response:
    owner = _owner(principal_of(request))
    if not bundles.exists(request.app[BLOBS], owner, request.match_info["sha256"]):
        raise errors.NotFound("no such bundle for this account")
    return web.Response(status=200)


async def put_final(request: web.Request) -> web.Response:
    principal = principal_of(request)
    name = request.match_info["name"]
    if principal.role is not Role.WORKER or principal.job != name:
        raise errors.Forbidden("only the job's workers store its final weights")
    async with request.app[state.DB].session() as s:
        job = await load_job(s, principal, name)
    if job.phase == "Profiling":
        raise errors.Conflict("a profile run's weights are not kept: the job's own run stores its final weights")
    size = await request.app[BLOBS].put(bundles.final_key(job.id), request.content.iter_chunked(1 << 20))
    return json_response({"name": f"{name}:final", "size": size}, status=201)


async def get_final(request: web.Request) -> web.StreamResponse:
    async with request.app[state.DB].session() as s:
        job = await load_job(s, principal_of(request), request.match_info["name"])
    chunks = await request.app[BLOBS].open(bundles.final_key(job.id))
    if chunks is None:
        raise errors.NotFound(f"job {job.name!r} has no final weights yet: rank 0 uploads them when the run "
                              f"ends (phase now {job.phase})")
    return await _stream(request, chunks, f"{job.name}-final.pt")


def setup(app: web.Application) -> None:
    one = "/api/v1/bundles/{sha256}"
    final = "/api/v1/jobs/{name}/final"
    for handler, doc in [
        (put_bundle, RouteDoc("PUT", one, "Upload a code bundle (.tar.gz; the body must hash to {sha256}); "
                              "201 stored, 200 already there, 413 over the limit", "Bundle", params=("sha256",))),
        (head_bundle, RouteDoc("HEAD", one, "Whether this account holds the bundle", "Bundle", params=("sha256",))),
        (get_bundle, RouteDoc("GET", one, "Download a code bundle (its owner, or the worker token of a job that "
                              "runs it)", "Bundle", params=("sha256",))),
        (put_final, RouteDoc("PUT", final, "Store the job's final weights (worker token)", "TrainingJob",
                             params=("name",))),
        (get_final, RouteDoc("GET", final, "Download the job's final weights (torch state_dict)", "TrainingJob",
                             params=("name",), later=True)),
    ]:
        add(app, handler, doc)
