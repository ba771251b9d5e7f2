"""Each module adds its commands to the `cpnctl` group on import."""

from cpn.cli.ctl.commands import contexts, jobs, resources

__all__ = ["contexts", "jobs", "resources"]
