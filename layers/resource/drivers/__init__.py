"""Site drivers: how work actually starts at a cluster, behind one interface."""

from layers.resource.drivers.base import DriverError, JobLaunch, SiteDriver, SubtaskLaunch, SubtaskState

__all__ = ["DriverError", "JobLaunch", "SiteDriver", "SubtaskLaunch", "SubtaskState"]
