"""Control layer: the live capacity view, reservations (leases) and the runtime topology."""
