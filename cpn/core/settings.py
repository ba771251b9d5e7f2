"""Typed settings read from `CPN_*` environment variables (pydantic-settings)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MAX_DEFAULT_WORKERS = 8  # API processes `cpn serve` runs by default on PostgreSQL (CPUs - 1, up to this)


def _default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "cpn"


class Settings(BaseSettings):
    """Server-side configuration. Every field maps to `CPN_<FIELD>`."""

    model_config = SettingsConfigDict(env_prefix="CPN_", extra="ignore")

    data_dir: Path = Field(default_factory=_default_data_dir, description="Where the embedded database lives.")
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy async URL; default sqlite+aiosqlite:///<data_dir>/cpn.db.",
    )
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    log_level: str = "INFO"
    max_body_bytes: int = Field(default=1024 * 1024, gt=0, description="Request bodies above this get 413.")
    heartbeat_timeout_seconds: float = Field(default=60.0, gt=0)
    quote_ttl_seconds: float = Field(default=900.0, gt=0)
    lease_ttl_seconds: float = Field(default=3600.0, gt=0)
    rate_limit_per_minute: int = Field(default=6000, gt=0, description="Requests per token per minute.")
    metrics_public: bool = Field(default=False, description="Serve /metrics without a token (it names clusters "
                                 "and counts jobs per phase); off: an admin token scrapes it.")
    reconcile: bool = Field(default=True, description="Run the job reconciler inside the API server.")
    reconcile_interval_seconds: float = Field(default=1.0, gt=0)
    claim_timeout_seconds: float = Field(default=120.0, gt=0, description="A sub-task no agent claims within "
                                         "this long fails its site; the job is re-placed.")
    blob_max_bytes: int = Field(default=8 * 1024**3, gt=0, description="Largest checkpoint or bundle file.")
    checkpoint_keep: int = Field(default=2, ge=1, le=1000, description="Checkpoint steps kept per job in the "
                                 "blob store (the newest committed ones; the step a new attempt would resume "
                                 "from and steps still being uploaded are kept too; final weights always). "
                                 "The sites' job runners read the same variable for their checkpoint folders.")
    bundle_max_bytes: int = Field(default=64 * 1024**2, gt=0, description="Largest code bundle (spec.code), "
                                  "compressed; larger uploads get 413.")
    workers: int | None = Field(default=None, ge=1, le=64, description=(
        "API server processes sharing the port (PostgreSQL only; one reconciler leads among them); default: "
        f"one per CPU but one (left to the database and clients), at least 1 and at most {MAX_DEFAULT_WORKERS}, "
        "on PostgreSQL, and 1 on SQLite (one process)"))
    blob_url: str | None = Field(default=None, description="Object store for checkpoints and bundles "
                                 "(s3://bucket/prefix, gs://…, az://…; credentials from the provider's "
                                 "environment variables); default: <data_dir>/blobs on the server's disk.")

    @field_validator("database_url")
    @classmethod
    def _async_driver(cls, v: str | None) -> str | None:
        return normalize_database_url(v) if v else v

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        allowed = {"DEBUG", "INFO", "WARNING", "ERROR"}
        if v.upper() not in allowed:
            raise ValueError(f"log level must be one of {sorted(allowed)}")
        return v.upper()

    @property
    def is_sqlite(self) -> bool:
        return self.effective_database_url.startswith("sqlite")

    @property
    def effective_workers(self) -> int:
        """How many API processes ``cpn serve`` runs (a ValueError for more than one on SQLite)."""
        if self.is_sqlite:
            if self.workers not in (None, 1):
                raise ValueError(f"workers {self.workers} needs PostgreSQL: the embedded SQLite database is "
                                 "served by one process (set CPN_DATABASE_URL, or drop --workers)")
            return 1
        if self.workers is not None:
            return self.workers
        return max(1, min(MAX_DEFAULT_WORKERS, usable_cpus() - 1))  # a CPU left for the database and clients

    @property
    def effective_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{self.data_dir / 'cpn.db'}"


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The CPUs this process may use: its affinity, capped by a container's CPU quota (cgroup v2
    ``cpu.max``, "quota period"; "max" is no cap), rounded up."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = cgroup.read_text().split()[:2]
    except (OSError, ValueError):
        return cpus
    if quota == "max":
        return cpus
    return max(1, min(cpus, -(-int(quota) // max(1, int(period)))))


ASYNC_DRIVERS = {"postgresql": "postgresql+asyncpg", "postgres": "postgresql+asyncpg",
                 "sqlite": "sqlite+aiosqlite"}


def normalize_database_url(url: str) -> str:
    """`postgresql://…` (no driver) means asyncpg and `sqlite:///…` aiosqlite, the async drivers CPN
    ships; a synchronous driver is refused with the fix instead of failing later on a missing module."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"{url!r} is not a URL; use postgresql+asyncpg://user@host/db or "
                         "sqlite+aiosqlite:///path/cpn.db")
    if scheme in ASYNC_DRIVERS:
        return f"{ASYNC_DRIVERS[scheme]}://{rest}"
    if scheme in ("postgresql+asyncpg", "sqlite+aiosqlite"):
        return url
    raise ValueError(f"the driver {scheme!r} is not one CPN runs on; use "
                     "postgresql+asyncpg://user@host/db (or just postgresql://…) or sqlite+aiosqlite:///path/cpn.db")


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def reset_settings() -> None:
    """Forget cached settings (tests change the environment)."""
    get_settings.cache_clear()
