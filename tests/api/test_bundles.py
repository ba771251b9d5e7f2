"""Code bundles over the API: content-addressed uploads, refusals that name the problem (a wrong
digest, `../` members, links out of the tree, device files, over the limit), each account sees only
its own, and a job naming a bundle its owner never uploaded is refused before it is priced."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from cpn.runtime.bundle import pack
from tests.api.test_jobs import job, quotes, register_world, submit


def tar_gz(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return raw.getvalue()


def member(name: str, data: bytes = b"x = 1\n", kind: bytes = tarfile.REGTYPE, link: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    return info, data if kind == tarfile.REGTYPE else None


def hex_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def user_code(tmp_path: Path) -> bytes:
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("def main():\n    pass\n")
    return pack(tmp_path / "code", 1 << 20)[0]


async def put(api, data: bytes, who: str = "alice", digest: str | None = None):  # type: ignore[no-untyped-def]
    return await api.client.put(f"/api/v1/bundles/{digest or hex_of(data)}", data=data,
                                headers={**api.auth(who), "Content-Type": "application/octet-stream"})


async def test_upload_is_content_addressed_and_private(api, tmp_path: Path) -> None:
    data = user_code(tmp_path)
    first = await put(api, data)
    assert first.status == 201, await first.text()
    assert (await put(api, data)).status == 200  # already there
    path = f"/api/v1/bundles/{hex_of(data)}"
    assert (await api.client.head(path, headers=api.auth("alice"))).status == 200
    got = await api.client.get(path, headers=api.auth("alice"))
    assert got.status == 200 and await got.read() == data
    for verb in ("head", "get"):  # bob cannot read or even probe alice's bundle
        assert (await getattr(api.client, verb)(path, headers=api.auth("bob"))).status == 404


@pytest.mark.parametrize(("members", "words"), [
    ([member("../evil.py")], ".."),
    ([member("/etc/cron.d/x")], "absolute"),
    ([member("out", kind=tarfile.SYMTYPE, link="../../etc/passwd")], "link"),
    ([member("dev", kind=tarfile.CHRTYPE)], "device"),
])
async def test_unsafe_archives_are_refused_and_nothing_is_kept(api, members: list, words: str) -> None:
    data = tar_gz(members)
    resp = await put(api, data)
    assert resp.status == 422, await resp.text()
    error = (await resp.json())["error"]
    assert words in error["message"], error
    assert (await api.client.head(f"/api/v1/bundles/{hex_of(data)}", headers=api.auth("alice"))).status == 404


async def test_wrong_digest_and_not_a_tarball(api, tmp_path: Path) -> None:
    data = user_code(tmp_path)
    resp = await put(api, data, digest="0" * 64)
    assert resp.status == 422 and "sha256" in (await resp.json())["error"]["message"]
    junk = b"just some bytes, not a .tar.gz"
    resp = await put(api, junk)
    assert resp.status == 422, await resp.text()


async def test_the_document_states_the_raw_body_and_an_upload_as_documented_is_stored(api, tmp_path: Path) -> None:
    # schemathesis found it: the byte-storing PUTs (bundle, checkpoint, final weights) published no
    # requestBody, so the document said nothing of the body the server requires
    doc = await (await api.client.get("/api/v1/openapi.json")).json()
    for path in ("/api/v1/bundles/{sha256}", "/api/v1/jobs/{name}/checkpoints/{step}/{file}",
                 "/api/v1/jobs/{name}/final"):
        body = doc["paths"][path]["put"]["requestBody"]
        assert body["required"] is True, path
        assert body["content"] == {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
    data = user_code(tmp_path)
    assert (await put(api, data)).status == 201
    empty = await put(api, b"", digest="0" * 64)  # no body: the bytes (none) do not hash to the URL's digest
    assert empty.status == 422 and (await empty.json())["error"]["field"] == "sha256"


async def test_a_bundle_over_the_limit_gets_413(api, settings) -> None:  # type: ignore[no-untyped-def]
    settings.bundle_max_bytes = 100_000  # the server's CPN_BUNDLE_MAX_BYTES, read per request
    data = tar_gz([member("big.bin", os.urandom(200_000))])  # random: gzip cannot shrink it under the limit
    resp = await put(api, data)
    assert resp.status == 413, await resp.text()
    assert "limit" in (await resp.json())["error"]["message"]


async def test_a_job_names_only_a_bundle_its_owner_uploaded(api, tmp_path: Path) -> None:
    await register_world(api)
    data = user_code(tmp_path)
    code = {"entrypoint": "train:main", "digest": f"sha256:{hex_of(data)}", "args": {"lr": 0.01}}
    body = job("mine", model={"parameters": 1_000_000}, code=code, tokens=1_000_000, globalBatchTokens=4096,
               gpus={"min": 1, "max": 2})
    resp = await submit(api, body)
    assert resp.status == 422, await resp.text()
    error = (await resp.json())["error"]
    assert error["field"] == "spec.code.digest" and "cpnctl apply" in error["message"]
    assert (await put(api, data, who="bob")).status == 201  # bob's copy does not count for alice
    assert (await submit(api, body)).status == 422
    assert (await put(api, data)).status == 201
    resp = await submit(api, body)
    assert resp.status == 201, await resp.text()
    stored = await resp.json()
    assert stored["spec"]["code"]["digest"] == code["digest"] and stored["spec"]["code"]["args"] == {"lr": 0.01}
    offered = await quotes(api, "mine")
    assert offered and all(q.get("pricingOnly") is None for q in offered)  # user code runs: not reference-only
