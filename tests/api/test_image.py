"""spec.image: a container image for the job's workers on Kubernetes clusters, carried in the contract."""

from __future__ import annotations

from tests.api.test_datasets import _claim
from tests.layers.orchestration.test_reconciler import _job, _world


async def test_the_contract_carries_the_jobs_image_and_a_bad_reference_is_refused(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    image = "registry.example.com:5000/team/trainer:v2@sha256:" + "ab" * 32
    for name, extra in (("boxed", {"image": image}), ("default", {})):
        resp = await api.client.post("/api/v1/jobs", headers=api.auth("alice"),
                                     json=_job(name, placement={"sites": ["fra-1"] if extra else ["ams-1"]}, **extra))
        assert resp.status == 201, await resp.text()
    assert (await _claim(api, db, "boxed", "prov-a"))["image"] == image
    assert (await _claim(api, db, "default", "prov-a"))["image"] is None  # the agent's own image then
    for bad in ("not an image", "x:", "a/../b", "x" * 256):
        resp = await api.client.post("/api/v1/jobs", headers=api.auth("alice"), json=_job("bad", image=bad))
        error = (await resp.json())["error"]
        assert resp.status == 422 and error["field"] == "spec.image", (bad, error)
