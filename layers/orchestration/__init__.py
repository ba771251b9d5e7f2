"""Orchestration & management: identity, jobs, scheduling, lifecycle, metrics, events."""
