"""Site drivers: how work actually starts at a cluster, behind one interface. Only site agents use
them; the API server never does."""

from layers.resource.drivers.base import DriverError, LogLine, SiteDriver, SubtaskState

__all__ = ["DriverError", "LogLine", "SiteDriver", "SubtaskState"]
