"""How the job runner marks each worker's lines in a log it shares with other workers (a pod's log,
which the kubernetes driver reads back by rank): ``[rank<global rank>]: <line>``. Its own module so
that a site agent can parse it without importing torch."""

from __future__ import annotations

import re

__all__ = ["RANK_LINE", "rank_prefix"]

RANK_LINE = re.compile(r"\[rank(\d+)\]:\s?(.*)")


def rank_prefix(rank: int) -> str:
    return f"[rank{rank}]: "
