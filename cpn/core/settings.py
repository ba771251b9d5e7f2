"""Typed settings read from `CPN_*` environment variables (pydantic-settings)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


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
    environment: str = Field(default="development", description="development | production")
    public_url: str | None = Field(default=None, description="URL workers use to reach this server.")
    reconcile: bool = Field(default=True, description="Run the job reconciler inside the API server.")
    reconcile_interval_seconds: float = Field(default=1.0, gt=0)
    wan_emulation: bool = Field(default=False, description="Local driver: shape WAN links with netns + tbf/htb "
                                "(needs root).")

    @property
    def run_root(self) -> Path:
        return self.data_dir / "runs"

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return (self.public_url or f"http://{host}:{self.port}").rstrip("/")

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        allowed = {"DEBUG", "INFO", "WARNING", "ERROR"}
        if v.upper() not in allowed:
            raise ValueError(f"log level must be one of {sorted(allowed)}")
        return v.upper()

    @property
    def effective_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{self.data_dir / 'cpn.db'}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def reset_settings() -> None:
    """Forget cached settings (tests change the environment)."""
    get_settings.cache_clear()
