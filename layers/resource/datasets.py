"""The Dataset kind: a user's data and the sites where replicas of it already live.

Storage is a resource like compute (Y.2501's resource layer). A Dataset belongs to the user who
creates it and lives in that user's namespace, as jobs do; other users never see it (404). A
TrainingJob's ``spec.dataset`` names one: placement then prices copying it to placed sites without
a replica (``data-transfer``), keeps the job inside ``spec.regions`` (residency), and each site's
workers read the replica at their site, or the nearest one (``CPN_DATA_URI``, ``job.data_uri``).

``format: tokens`` (with ``vocab``) is the one format CPN itself reads: a flat little-endian uint16
(``vocab`` <= 65536) or uint32 file of token ids, on which a job without ``spec.code`` trains its
built-in model (whose vocabulary becomes ``vocab``). Any other format is free text for the user's code.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator
from sqlalchemy import Float, String, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from cpn.core import errors
from cpn.core.db import Base
from cpn.core.kinds import AGE, Column, Kind, KindRegistry
from cpn.core.manifest import CamelModel, ManifestBase, Name
from cpn.core.principal import Principal, Role
from cpn.core.store import KEY_LEN, NS_SEP, ResourceRow, ResourceStore, is_retired, qualify
from layers.resource.schemas import REGION_RE
from layers.resource.stores import site_by_name

MAX_LOCATIONS = 64
TOKENS = "tokens"  # the format CPN's built-in model reads (flat token ids)
TOKENS_MAX_VOCAB = 2**32


class DatasetRow(ResourceRow, Base):
    __tablename__ = "datasets"

    name: Mapped[str] = mapped_column(String(KEY_LEN), unique=True, nullable=False)  # "<owner>/<name>"
    size_gb: Mapped[float] = mapped_column(Float, nullable=False)


class DatasetLocation(CamelModel):
    site: Name = Field(description="A registered site holding a replica")
    uri: str = Field(min_length=1, max_length=2048, description="Where workers at that site read it "
                     "(s3://…, file:///…, any URI the training code understands)")


class DatasetSpec(CamelModel):
    size_gb: float = Field(alias="sizeGB", gt=0, le=1e9, description="Size in GB (10⁹ bytes): what a copy moves")
    format: str | None = Field(default=None, max_length=100, description=(
        "tokens: flat little-endian uint16/uint32 token ids that CPN's built-in model trains on (give vocab); "
        "anything else is free text for your code (parquet, jsonl, …)"))
    vocab: int | None = Field(default=None, ge=2, le=TOKENS_MAX_VOCAB, validate_default=True, description=(
        "format: tokens: the number of token ids (ids < vocab; uint16 up to 65536, uint32 above)"))
    locations: list[DatasetLocation] = Field(min_length=1, max_length=MAX_LOCATIONS,
                                             description="Sites where replicas already live, and their URIs")
    regions: list[str] = Field(default_factory=list, max_length=64, description=(
        "Residency: jobs on this dataset are placed only in these regions (empty: anywhere)"))

    @field_validator("vocab")
    @classmethod
    def _vocab(cls, v: int | None, info: ValidationInfo) -> int | None:
        tokens = info.data.get("format") == TOKENS
        if tokens and v is None:
            raise ValueError("format: tokens needs spec.vocab, the number of token ids (e.g. 50257 for GPT-2's "
                             "tokenizer, 128256 for Llama 3's): add it")
        if not tokens and v is not None:
            raise ValueError(f"spec.vocab is for spec.format: tokens (a flat file of token ids CPN's model trains on), "
                             f"not {info.data.get('format')!r}: set format: tokens or drop vocab")
        return v

    @field_validator("regions")
    @classmethod
    def _regions(cls, v: list[str]) -> list[str]:
        for region in v:
            if not REGION_RE.match(region):
                raise ValueError(f"region {region!r}: lowercase letters, digits and '-', as a Site's spec.region")
        return v


class DatasetManifest(ManifestBase):
    kind: Literal["Dataset"] = "Dataset"
    spec: DatasetSpec
    status: dict[str, Any] | None = None


Users = Callable[[AsyncSession, str, str], Awaitable[list[str]]]  # (session, owner id, key) → active job names


class DatasetStore(ResourceStore):
    kind = "Dataset"
    row = DatasetRow
    manifest = DatasetManifest
    create_roles: ClassVar[frozenset[Role]] = frozenset({Role.USER, Role.ADMIN})
    not_found_hides = True
    namespaced = True  # stored as "<account>/<name>", like jobs
    users: Users | None = None  # the jobs still reading a dataset (orchestration, passed in by the wiring)

    def visible(self, principal: Principal, row: ResourceRow) -> bool:
        return principal.owns(row.owner_id)

    def filter_query(self, stmt: Any, principal: Principal, filters: dict[str, str]) -> Any:
        if not principal.is_admin:
            stmt = stmt.where(DatasetRow.owner_id == principal.account_id)
        if filters.get("namespace"):
            stmt = stmt.where(DatasetRow.name.startswith(qualify(filters["namespace"], ""), autoescape=True))
        return stmt

    async def prepare(self, session: AsyncSession, principal: Principal, obj: Any,
                      row: ResourceRow | None) -> dict[str, Any]:
        seen: set[str] = set()
        for i, loc in enumerate(obj.spec.locations):
            if loc.site in seen:
                raise errors.InvalidInput(f"site {loc.site!r} is listed twice: one replica per site",
                                          field=f"spec.locations[{i}].site")
            seen.add(loc.site)
            if await site_by_name(session, loc.site) is None:
                raise errors.InvalidInput(f"unknown site {loc.site!r}: a replica lives at a registered site "
                                          "(cpnctl get sites)", field=f"spec.locations[{i}].site")
        return {}

    def status_view(self, row: ResourceRow, now: Any = None) -> dict[str, Any]:
        spec = row.spec or {}
        sites = [loc["site"] for loc in spec.get("locations", [])]
        return {"replicas": len(sites), "sites": ",".join(sites), "regions": ",".join(spec.get("regions") or []) or "any"}

    def derive(self, row: ResourceRow, obj: Any, refs: dict[str, Any]) -> None:
        row.size_gb = obj.spec.size_gb  # type: ignore[attr-defined]

    async def before_delete(self, session: AsyncSession, principal: Principal, row: ResourceRow) -> None:
        jobs = await self.users(session, row.owner_id, row.name) if self.users else []
        if jobs:
            raise errors.InUse(f"dataset {row.name!r} is read by job(s) {', '.join(jobs)}; delete it when they "
                               "finish or are cancelled")


async def find_dataset(session: AsyncSession, owner_id: str, namespace: str, name: str) -> DatasetRow | None:
    """The Dataset a job of `owner_id` in `namespace` means by `name` (bare: in its namespace); None
    when there is none the owner may read."""
    key = name if NS_SEP in name else qualify(namespace, name)
    if is_retired(key):
        return None
    row = (await session.execute(select(DatasetRow).where(DatasetRow.name == key))).scalar_one_or_none()
    return row if row is not None and row.owner_id == owner_id else None


def register(registry: KindRegistry, users: Users | None = None) -> None:
    store = DatasetStore()
    store.users = users
    registry.register(Kind(
        kind="Dataset", plural="datasets", short_names=("dataset", "ds"), manifest=DatasetManifest, store=store,
        order=40, columns=(Column("SIZE GB", "{spec.sizeGB}"), Column("FORMAT", "{spec.format}"),
                           Column("REPLICAS", "{status.replicas}"), Column("REGIONS", "{status.regions}"), AGE,
                           Column("SITES", "{status.sites}", wide=True))))
