"""Imports every layer's tables so that Base.metadata is complete (for Alembic and tests)."""

from layers.orchestration.identity import models as identity_models
from layers.resource import models as resource_models

__all__ = ["identity_models", "resource_models"]
