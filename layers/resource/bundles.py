"""Code bundles and final weights in the blob store.

A bundle is stored under its owner's account and its sha256 (``bundles/<account>/<hex>.tar.gz``), so
one user cannot read, overwrite or even probe another's. An upload is hashed and its tar headers are
checked (:func:`cpn.runtime.bundle.check_members`) before anything is stored: a wrong digest, an
archive that is not a ``.tar.gz``, a member outside the tree (absolute, ``..``, a link out), a
device file, or a bundle over the limit is refused and nothing is kept. The server never extracts,
imports or runs a bundle: the sites' job runners do, in the workers' sandbox.

A job's final weights (rank 0's ``final_model.pt``) are stored under the job's uid.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import tempfile
from collections.abc import AsyncIterator
from typing import IO

from cpn.core import errors
from cpn.runtime.bundle import UNPACK_FACTOR, BundleError, BundleTooLarge, check_members
from layers.resource.blobs import CHUNK, BlobStore

HEX_RE = re.compile(r"^[0-9a-f]{64}$")
FINAL = "final/model.pt"


def hex_of(raw: str) -> str:
    """The 64 hex digits of ``sha256:<hex>`` or ``<hex>``; InvalidInput otherwise."""
    value = raw.removeprefix("sha256:")
    if not HEX_RE.match(value):
        raise errors.InvalidInput(f"bundle digest {raw[:80]!r} is not a sha256 (64 lowercase hex digits)",
                                  field="sha256")
    return value


def key(owner: str, digest: str) -> str:
    return f"bundles/{owner}/{hex_of(digest)}.tar.gz"


def final_key(job_uid: str) -> str:
    return f"{job_uid}/{FINAL}"


def exists(store: BlobStore, owner: str, digest: str) -> bool:
    return store.exists(key(owner, digest))


async def _spool(chunks: AsyncIterator[bytes], max_bytes: int, fh: IO[bytes]) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise errors.PayloadTooLarge(f"bundle is over the limit of {max_bytes:,} bytes: leave large files out "
                                         "with .cpnignore (data belongs in spec.dataset)", field="body")
        h.update(chunk)
        fh.write(chunk)
    return h.hexdigest(), size


async def put(store: BlobStore, owner: str, digest: str, chunks: AsyncIterator[bytes], max_bytes: int) -> dict:
    """Store a bundle whose bytes must hash to ``digest``; {"digest", "size", "created"}."""
    hexdigest = hex_of(digest)
    name = key(owner, hexdigest)
    with tempfile.TemporaryFile() as fh:
        got, size = await _spool(chunks, max_bytes, fh)
        if got != hexdigest:
            raise errors.InvalidInput(f"bundle bytes hash to sha256:{got}, not the sha256:{hexdigest} in the URL: "
                                      "the upload was altered or truncated", field="sha256")
        if store.exists(name):
            return {"digest": f"sha256:{hexdigest}", "size": size, "created": False}
        fh.seek(0)
        try:
            members = await asyncio.to_thread(check_members, fh, max_bytes * UNPACK_FACTOR)
        except BundleTooLarge as exc:
            raise errors.PayloadTooLarge(str(exc), field="body") from None
        except BundleError as exc:
            raise errors.InvalidInput(str(exc), field="body") from None
        fh.seek(0)

        async def again() -> AsyncIterator[bytes]:
            while chunk := fh.read(CHUNK):
                yield chunk

        await store.put(name, again())
    return {"digest": f"sha256:{hexdigest}", "size": size, "members": members, "created": True}


async def open_bundle(store: BlobStore, owner: str, digest: str) -> AsyncIterator[bytes]:
    chunks = await store.open(key(owner, digest))
    if chunks is None:
        raise errors.NotFound(f"no bundle sha256:{hex_of(digest)} for this account: upload it with "
                              "`cpnctl apply -f job.yaml` (it packs spec.code.path)")
    return chunks
