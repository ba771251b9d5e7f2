"""Issue 35, H5: a bundle's PAX and GNU long headers count, and the decompressed stream is capped: a
389 KB bundle with a 400 MB PAX comment took the server from 427 MB to 1.94 GB during the check."""

from __future__ import annotations

import gzip
import hashlib
import io
import resource
import tarfile
import time

import pytest

from cpn.runtime import bundle


def _bomb(header_bytes: int, gnu: bool = False) -> bytes:
    buf = io.BytesIO()
    fmt = tarfile.GNU_FORMAT if gnu else tarfile.PAX_FORMAT
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9) as gz, tarfile.open(fileobj=gz, mode="w",
                                                                                    format=fmt) as tar:
        info = tarfile.TarInfo(("d/" * (header_bytes // 2)) + "main.py" if gnu else "main.py")
        info.size = 9
        if not gnu:
            info.pax_headers = {"comment": "x" * header_bytes}
        tar.addfile(info, io.BytesIO(b"print(1)\n"))
    return buf.getvalue()


@pytest.mark.parametrize("gnu", [False, True])
def test_long_headers_past_the_cap_are_refused_before_they_are_read(gnu: bool) -> None:
    data = _bomb(8 * bundle.MAX_HEADER_BYTES, gnu=gnu)
    assert len(data) < 100_000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(bundle.BundleHeadersTooLarge, match="extended .* headers hold more than"):
        bundle.check_members(io.BytesIO(data), 10**9)
    assert time.perf_counter() - start < 0.5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB: no 8 MB header read


def test_a_normal_pax_header_still_passes() -> None:
    assert bundle.check_members(io.BytesIO(_bomb(1000)), 10**6) == 1


def test_the_decompressed_stream_is_capped_whatever_the_headers_say(tmp_path) -> None:  # type: ignore[no-untyped-def]
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb") as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for i in range(40):  # 40 members of 1 MB zeros: each under the cap, all of them over it
            info = tarfile.TarInfo(f"f{i}")
            info.size = 1 << 20
            tar.addfile(info, io.BytesIO(bytes(info.size)))
    with pytest.raises(bundle.BundleTooLarge):
        bundle.check_members(io.BytesIO(buf.getvalue()), 8 << 20)
    archive = tmp_path / "b.tar.gz"
    archive.write_bytes(_bomb(2 * bundle.MAX_HEADER_BYTES))
    with pytest.raises(bundle.BundleHeadersTooLarge):  # the site's runner refuses it too
        bundle.extract(archive, tmp_path / "out", 10**9)
    assert not (tmp_path / "out").exists()


async def test_the_pax_bomb_upload_is_a_422_naming_the_body(api) -> None:  # type: ignore[no-untyped-def]
    data = _bomb(16 * bundle.MAX_HEADER_BYTES)
    start = time.perf_counter()
    r = await api.client.put(f"/api/v1/bundles/{hashlib.sha256(data).hexdigest()}", data=data,
                             headers={**api.auth("alice"), "Content-Type": "application/gzip"})
    body = await r.json()
    assert r.status == 422 and body["error"]["field"] == "body" and "headers" in body["error"]["message"], body
    assert time.perf_counter() - start < 1.0
