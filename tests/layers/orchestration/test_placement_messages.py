"""Placement's refusals read in human units and never blame a field the user did not set."""

from __future__ import annotations

import re

import pytest

from cpn.core.errors import Infeasible
from layers.orchestration.planning import placement
from tests.layers.orchestration.test_placement import BALANCED, LINKS, OFFERS, job


def test_no_offers_at_all_does_not_blame_gpu_models() -> None:
    with pytest.raises(Infeasible) as caught:
        placement.plan(job(), [], LINKS, BALANCED, "heuristic")
    assert caught.value.message == "no Ready cluster has free GPUs priced in USD"
    assert caught.value.field is None


def test_a_one_second_deadline_reads_in_units() -> None:
    with pytest.raises(Infeasible) as caught:
        placement.plan(job(deadline_seconds=1.0), OFFERS, LINKS, BALANCED, "heuristic")
    assert caught.value.field == "spec.deadline"
    assert re.fullmatch(r"spec\.deadline: fastest feasible placement needs \d+ (s|min \d+ s|h \d\d min|d \d+ h), "
                        r"the deadline allows 1 s", caught.value.message), caught.value.message
