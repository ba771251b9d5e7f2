"""Imports every layer's tables so that Base.metadata is complete (for Alembic and tests)."""

from layers.control import models as control_models
from layers.orchestration import events as orchestration_events
from layers.orchestration.identity import models as identity_models
from layers.orchestration.lifecycle import models as lifecycle_models
from layers.orchestration.quotas import models as quota_models
from layers.resource import datasets as resource_datasets
from layers.resource import models as resource_models
from layers.service import models as service_models

__all__ = ["control_models", "identity_models", "lifecycle_models", "orchestration_events", "quota_models",
           "resource_datasets", "resource_models", "service_models"]
