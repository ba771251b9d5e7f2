"""Workers write a human progress line to their log: what `cpnctl logs` shows while a job runs."""

from __future__ import annotations

import io

from cpn.runtime.metrics import LogSink


def _report(step: int, **kw: object) -> dict:
    return {"step": step, "tokens": step * 3072, "trainLoss": 3.0, "valLoss": None, "tokensPerSecond": 5000.0,
            "wanBytes": 0, "final": False, **kw}


def test_a_line_per_validation_at_most_one_other_per_interval_and_the_last() -> None:
    out = io.StringIO()
    sink = LogSink(every=3600, stream=out)
    for step in range(1, 6):
        sink.emit(_report(step))
    sink.emit(_report(6, valLoss=2.5))
    sink.emit(_report(7))
    sink.emit(_report(8, final=True, wanBytes=2_500_000, jobTokens=73_728))
    lines = out.getvalue().splitlines()
    assert lines == [
        "step 1 · 3,072 tokens · train loss 3.0000 · 5,000 tokens/s",
        "step 6 · 18,432 tokens · train loss 3.0000 · val loss 2.5000 · 5,000 tokens/s",
        "step 8 · 73,728 tokens · train loss 3.0000 · 5,000 tokens/s · WAN 2.5 MB · done",
    ]
