"""Each module adds its commands to the `cpnctl` group on import."""

from cpn.cli.ctl.commands import auth, contexts, jobs, resources

__all__ = ["auth", "contexts", "jobs", "resources"]
