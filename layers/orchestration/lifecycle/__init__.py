"""The job lifecycle after a reservation: launch sub-tasks through site drivers, watch them,
meter progress, recover from failures, finish. Driven by a restart-safe reconciler."""
