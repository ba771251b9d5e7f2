"""Contexts in `~/.cpn/config` (mode 0600), overridable by flags and CPN_SERVER / CPN_TOKEN."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError

from cpn.core.yamlload import ManifestLoader


class ContextEntry(BaseModel):
    name: str
    server: str
    token: str | None = None


class ConfigFile(BaseModel):
    current_context: str | None = Field(default=None, alias="currentContext")
    contexts: list[ContextEntry] = Field(default_factory=list)

    model_config = {"populate_by_name": True}

    def find(self, name: str) -> ContextEntry | None:
        return next((c for c in self.contexts if c.name == name), None)


def config_path() -> Path:
    return Path(os.environ.get("CPN_CONFIG") or Path.home() / ".cpn" / "config")


class ConfigError(Exception):
    pass


def load() -> ConfigFile:
    path = config_path()
    if not path.exists():
        return ConfigFile()
    try:
        data = yaml.load(path.read_text(), Loader=ManifestLoader) or {}  # noqa: S506 - a SafeLoader, no aliases
        return ConfigFile.model_validate(data)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path} is not a valid cpnctl config: broken YAML{where}: {problem}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(x) for x in first["loc"]) or "the file"
        raise ConfigError(f"{path} is not a valid cpnctl config: {field}: {first['msg']} (fix it, or remove the "
                          "file and run cpnctl config set-context again)") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not a valid cpnctl config: not a text file") from exc


def save(cfg: ConfigFile) -> None:
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    data: dict[str, Any] = cfg.model_dump(by_alias=True, exclude_none=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(data, fh, sort_keys=False)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


@dataclass
class Target:
    server: str | None
    token: str | None
    context: str | None = None  # the config context that supplied a value, if any
    from_context: tuple[str, ...] = ()  # which of "server", "token" it supplied

    def source_note(self) -> str | None:
        """One line saying what came from the cpnctl config (never the token itself), or None."""
        if not self.from_context:
            return None
        return (f"using the {' and '.join(self.from_context)} of cpnctl context {self.context!r} in {config_path()}"
                f" (server {self.server}); --server/--token or CPN_SERVER/CPN_TOKEN override it")


def resolve(server: str | None, token: str | None, context: str | None) -> Target:
    """Flags beat environment, environment beats the selected context."""
    cfg = load()
    name = context or cfg.current_context
    entry = cfg.find(name) if name else None
    if context and entry is None:
        raise ConfigError(f"context {context!r} not found in {config_path()}")
    server = server or os.environ.get("CPN_SERVER")
    token = token or os.environ.get("CPN_TOKEN")
    supplied = tuple(field for field, given in (("server", server), ("token", token))
                     if not given and entry is not None and getattr(entry, field))
    return Target(server=server or (entry.server if entry else None), token=token or (entry.token if entry else None),
                  context=entry.name if supplied and entry else None, from_context=supplied)
