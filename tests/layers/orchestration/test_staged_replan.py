"""Re-placing a pipeline after a site failure (issue 14, item 3): a staged plan again, on live sites
only, with as many stages as the checkpoint holds (the runtime cannot load a checkpoint cut for
another stage count); too few sites left fails naming the lost site, not a field of the spec.
End to end: tests/e2e/test_staged_failure.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from cpn.core.errors import Infeasible
from layers.orchestration.lifecycle.replan import replace_placement, stages_of
from layers.service.models import JobRow
from tests.api.test_jobs import submit
from tests.api.test_pipeline_jobs import SITES, _job, _register

LIMITS = {"heartbeat_timeout": timedelta(seconds=60), "lease_ttl": timedelta(hours=1)}


async def _accepted(api, name: str, **spec: object) -> None:  # type: ignore[no-untyped-def]
    assert (await submit(api, _job(name, **spec))).status == 201
    resp = await api.client.post(f"/api/v1/jobs/{name}/accept", json={"quote": "balanced"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()


async def _row(s, name: str) -> JobRow:  # type: ignore[no-untyped-def]
    return (await s.execute(select(JobRow).where(JobRow.name == f"alice/{name}"))).scalar_one()


def test_stages_of_counts_a_placements_stages() -> None:
    assert stages_of([{"site": "a", "stage": 0}, {"site": "b", "stage": 1}, {"site": "b", "stage": 1}]) == 2
    assert stages_of([{"site": "a", "gpus": 1}]) is None


async def test_a_lost_stage_site_is_re_placed_as_a_pipeline_on_the_live_sites(api, db) -> None:  # type: ignore[no-untyped-def]
    await _register(api)  # `tiny` fits these GPUs as two stages only
    await _accepted(api, "staged")
    async with db.session() as s:
        row = await _row(s, "staged")
        first = {p["stage"]: p["site"] for p in row.status["placement"]}
        assert sorted(first) == [0, 1], first
        placed = await replace_placement(s, row, {first[1]}, **LIMITS)
        assert sorted(p["stage"] for p in placed) == [0, 1], placed
        assert first[1] not in {p["site"] for p in placed} and len({p["site"] for p in placed}) == 2, placed
        with pytest.raises(Infeasible) as err:
            await replace_placement(s, row, set(first.values()), **LIMITS)
    (left,) = set(SITES) - set(first.values())
    assert err.value.field is None, err.value  # the lost sites' fault, no field of the spec's
    assert err.value.message == (f"no placement without the failed site(s) {sorted(first.values())}: its checkpoint "
                                 "holds 2 pipeline stages, each to resume on a site of its own (one stage per site), "
                                 f"and only 1 live site(s) remain ({left})"), err.value.message


async def test_the_stage_count_is_kept_even_when_fewer_stages_would_fit(api, db) -> None:  # type: ignore[no-untyped-def]
    await _register(api, memory_gb=24)  # here two stages would fit, and so would three
    await _accepted(api, "cut3", strategy="pipeline", parallelism={"pipelineStages": 3})
    async with db.session() as s:
        row = await _row(s, "cut3")
        assert stages_of(row.status["placement"]) == 3
        row.spec = {k: v for k, v in row.spec.items() if k != "parallelism"}  # the count comes from the placement
        with pytest.raises(Infeasible) as err:
            await replace_placement(s, row, {"waw-1"}, **LIMITS)
    assert "its checkpoint holds 3 pipeline stages" in err.value.message, err.value.message
    assert "only 2 live site(s) remain (ams-1, fra-1)" in err.value.message, err.value.message
