"""placement.quote_options on worker threads: one planning per distinct inputs, however many callers."""

from __future__ import annotations

import threading
import time

import pytest

from cpn.core.errors import Infeasible
from layers.orchestration.planning import placement


def test_callers_with_the_same_inputs_wait_for_one_planning(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def plan(req, offers, links, objective, solver):  # noqa: ANN001, ANN202 - stands in for the planner
        calls.append(req)
        time.sleep(0.3)  # long enough for every other caller to arrive while it plans
        return {"cheapest": req}

    monkeypatch.setattr(placement, "_quote_options", plan)
    results: list[dict] = []
    threads = [threading.Thread(target=lambda: results.append(placement.quote_options("job-a", (), (), "o")))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert calls == ["job-a"] and results == [{"cheapest": "job-a"}] * 6
    assert placement._PLANNING == {}  # noqa: SLF001 - nothing left claimed


def test_a_failed_planning_releases_its_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    def plan(req, offers, links, objective, solver):  # noqa: ANN001, ANN202
        raise Infeasible("no capacity")

    monkeypatch.setattr(placement, "_quote_options", plan)
    for _ in range(2):  # the second call plans again instead of waiting for ever
        with pytest.raises(Infeasible):
            placement.quote_options("job-b", (), (), "o")
    assert placement._PLANNING == {}  # noqa: SLF001
