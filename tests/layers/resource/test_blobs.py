"""The blob store, on disk (the default) and in an object store (obstore's in-memory one stands in for
S3 here: the same code path, `from_url`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cpn.core import errors
from layers.orchestration.lifecycle import checkpoints
from layers.resource.blobs import BlobStore


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


@pytest.fixture(params=["disk", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs" if request.param == "disk" else "memory:///", max_bytes=16)


async def test_put_read_list_and_stream(store: BlobStore) -> None:
    assert await store.put("job-1/checkpoints/step-00000001/latest.json", _chunks(b'{"step"', b": 1}")) == 11
    assert store.exists("job-1/checkpoints/step-00000001/latest.json")
    assert store.read_text("job-1/checkpoints/step-00000001/latest.json") == '{"step": 1}'
    assert store.list("job-1/checkpoints") == ["job-1/checkpoints/step-00000001/latest.json"]
    stream = await store.open("job-1/checkpoints/step-00000001/latest.json")
    assert stream is not None and b"".join([c async for c in stream]) == b'{"step": 1}'
    assert await store.open("job-1/checkpoints/step-00000002/latest.json") is None
    assert not store.exists("job-2/x.pt") and store.list("job-2") == []


async def test_too_large_stores_nothing_and_bad_names_are_refused(store: BlobStore) -> None:
    with pytest.raises(errors.PayloadTooLarge):
        await store.put("job-1/big.pt", _chunks(b"123456789", b"0123456789"))
    assert not store.exists("job-1/big.pt") and store.list("job-1") == []
    for bad in ("../etc/passwd", "job-1/../x", "/abs/x", "Job/x"):
        with pytest.raises(errors.InvalidInput):
            await store.put(bad, _chunks(b"x"))


async def test_the_newest_complete_checkpoint_is_found_in_either_store(store: BlobStore) -> None:
    store.max_bytes = 1000
    for step, files in ((1, ("global.pt", "site0.pt")), (2, ("global.pt",))):  # step 2 lacks site0.pt
        for name in files:
            await store.put(f"uid/checkpoints/step-{step:08d}/{name}", _chunks(b"w"))
        await store.put(f"uid/checkpoints/step-{step:08d}/latest.json", _chunks(f'{{"step": {step}, "sites": [0]}}'.encode()))
    found = checkpoints.latest(store, "uid")
    assert found is not None and found["step"] == 1
    assert found["files"] == ["step-00000001/global.pt", "step-00000001/site0.pt"]
