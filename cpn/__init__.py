"""CPN: a cross-datacenter compute-network orchestrator (ITU-T Y.2501 shape)."""

__version__ = "0.1.0"
API_VERSION = "cpn/v1"

__all__ = ["API_VERSION", "__version__"]
