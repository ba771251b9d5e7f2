"""The job lifecycle after a reservation: write each attempt's desired state (its sub-tasks and their
contracts) for the site agents to claim and run, read the phases, logs and metrics they report,
meter progress, recover from failures, finish. Driven by a restart-safe reconciler; the API server
starts no worker and calls no site."""
