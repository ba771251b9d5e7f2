"""Each module adds its commands to the `cpnctl` group on import."""

from cpn.cli.ctl.commands import contexts, resources

__all__ = ["contexts", "resources"]
