"""A job's `spec.dataset`: the Dataset it names, as placement needs it and as a site's workers read it.

`spec.dataset` names a Dataset in the job's namespace (the owner's); a name that is not one is a
built-in corpus of CPN's runtime (:data:`BUILTIN_DATASETS`), present at every site, or a mistake.
"""

from __future__ import annotations

import functools
from decimal import Decimal
from typing import Any

from sqlalchemy import bindparam, func, literal, select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.phases import JOB_DRAFT, JOB_TERMINAL
from cpn.core.store import NS_SEP, RETIRED, qualify, split_key
from cpn.runtime.contract import DataRef
from layers.orchestration.planning import data as data_model
from layers.orchestration.planning.types import DataNeed, WanLink
from layers.resource.datasets import DatasetRow, find_dataset
from layers.resource.models import LinkRow
from layers.resource.stores import link_active
from layers.service.models import JobRow

# The corpora CPN's own runtime reads (cpn/runtime/data.py: the Python standard library's sources).
BUILTIN_DATASETS = frozenset({"pystdlib"})


def need_of(row: DatasetRow) -> DataNeed:
    spec = row.spec or {}
    return DataNeed(name=split_key(row.name)[1], size_gb=float(spec["sizeGB"]),
                    replicas=frozenset(loc["site"] for loc in spec.get("locations", [])),
                    regions=frozenset(spec.get("regions") or ()) or None)


async def need(session: AsyncSession, owner_id: str, namespace: str, dataset: str) -> DataNeed | None:
    """The Dataset a job of `owner_id` in `namespace` names (None: a built-in corpus); an unknown name
    is refused naming spec.dataset."""
    row = await find_dataset(session, owner_id, namespace, dataset)
    if row is not None:
        return need_of(row)
    return _no_dataset(namespace, dataset)


PROBE_TAG = "dataset"


@functools.cache  # one statement object, so the round trip it joins is built once
def probe() -> Any:
    """How many Datasets the owner holds under a job's dataset key, in the shape of the catalogue's
    stamp rows (:func:`layers.control.capacity.offer_set` sends it in its round trip); values from
    :func:`probe_params`."""
    return select(literal(PROBE_TAG), func.count(), func.max(DatasetRow.updated_at), literal(0)).where(
        DatasetRow.name == bindparam("dataset_key"), DatasetRow.owner_id == bindparam("dataset_owner"))


def probe_params(owner_id: str, namespace: str, dataset: str) -> dict[str, str]:
    return {"dataset_key": dataset if NS_SEP in dataset else qualify(namespace, dataset), "dataset_owner": owner_id}


async def need_probed(session: AsyncSession, owner_id: str, namespace: str, dataset: str, probed: Any
                      ) -> DataNeed | None:
    """`need`, without its read when the `probe` row says the owner holds no Dataset of that name
    (a built-in corpus, or a mistake)."""
    if probed[1]:
        return await need(session, owner_id, namespace, dataset)
    return _no_dataset(namespace, dataset)


def _no_dataset(namespace: str, dataset: str) -> None:
    if dataset in BUILTIN_DATASETS:
        return None
    raise errors.InvalidInput(f"spec.dataset: there is no Dataset {dataset!r} in namespace {namespace!r} and it is "
                              f"not a built-in corpus ({', '.join(sorted(BUILTIN_DATASETS))}): create it first "
                              "(kind: Dataset, see docs/byo.md) or leave spec.dataset out", field="spec.dataset")


async def need_of_job(session: AsyncSession, job: JobRow) -> DataNeed | None:
    return await need(session, job.owner_id, split_key(job.name)[0] or "", (job.spec or {}).get("dataset") or "")


async def wan_links(session: AsyncSession) -> list[WanLink]:
    rows = (await session.execute(select(LinkRow).where(LinkRow.name.not_like(f"{RETIRED}%")))).scalars()
    return [WanLink(a=r.spec["a"], b=r.spec["b"], bandwidth_gbps=float(r.spec["bandwidthGbps"]),
                    rtt_ms=float(r.spec.get("rttMs") or 0.0), price_per_gb=Decimal(str(r.spec.get("pricePerGB") or 0)))
            for r in rows if link_active(r.status)]  # pending (one provider's) links carry no data


async def data_ref(session: AsyncSession, job: JobRow, site: str) -> DataRef | None:
    """What the workers at `site` read: the replica there, else the one their copy comes from (the
    cheapest link path, as the quote priced it), else the first listed. None for a built-in corpus."""
    spec = job.spec or {}
    row = await find_dataset(session, job.owner_id, split_key(job.name)[0] or "", spec.get("dataset") or "")
    if row is None:
        return None
    uris = {loc["site"]: loc["uri"] for loc in (row.spec or {}).get("locations", [])}
    uri = uris.get(site)
    if uri is None:
        move = data_model.routes(need_of(row), [site], await wan_links(session))[site]
        source = move.source if move is not None else None
        uri = uris.get(source) if source else next(iter(uris.values()), None)
    return DataRef(dataset=split_key(row.name)[1], uri=uri, format=(row.spec or {}).get("format"),
                   vocab=(row.spec or {}).get("vocab"))


async def readers(session: AsyncSession, owner_id: str, key: str) -> list[str]:
    """The owner's accepted, unfinished jobs that read the Dataset stored as `key`."""
    done = [p.value for p in (*JOB_TERMINAL, *JOB_DRAFT)]
    rows = (await session.execute(select(JobRow.name, JobRow.spec).where(
        JobRow.owner_id == owner_id, JobRow.phase.not_in(done)).order_by(JobRow.name))).all()
    return [split_key(name)[1] for name, spec in rows if (spec or {}).get("dataset") in (key, split_key(key)[1])]


def lines_info(moves: dict[str, Any]) -> dict[str, Any]:
    """The quote's record of its dataset copies (prediction.dataTransfer)."""
    return {site: {"from": m.source, "gb": m.gb, "pricePerGB": str(m.price_per_gb), "seconds": round(m.seconds, 3)}
            for site, m in moves.items()}
