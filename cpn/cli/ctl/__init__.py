"""`cpnctl`: the kubectl-style client. Speaks only HTTP (through :mod:`cpn.client`)."""
