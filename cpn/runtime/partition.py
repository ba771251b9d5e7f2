"""The cut of a model into pipeline stages, without torch: the runtime cuts by it (``stages.py``) and
the planner prices the same cut (``layers/orchestration/planning/perf.py``) inside the API server."""

from __future__ import annotations

__all__ = ["partition"]


def partition(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous, non-empty ``[start, end)`` runs of ``sizes`` minimising the largest sum."""
    n = len(sizes)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} units into {parts} stages: use between 1 and {n} stages")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: the smallest max-stage sum covering units [0, i) with k stages; back[k][i]: the last cut
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], back[k][i] = cost, j
    runs, i = [], n
    for k in range(parts, 0, -1):
        runs.append((back[k][i], i))
        i = back[k][i]
    return runs[::-1]
