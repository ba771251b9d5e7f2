"""The four Y.2501 layers: resource, control, service, orchestration & management."""
