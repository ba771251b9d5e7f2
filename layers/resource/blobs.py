"""The blob store every site can reach: checkpoints (so a re-placed attempt resumes at a site that
never held them), code bundles and final weights.

By default files on the API server's disk under ``<data_dir>/blobs``; with ``CPN_BLOB_URL`` an object
store instead (``s3://bucket/prefix`` for S3 or any S3-compatible service, ``gs://``, ``az://``,
``memory:///`` for tests), through `obstore` (the Rust `object_store` crate). Credentials come from
the provider's usual environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL`` …), never
from a command line. A write is all or nothing: a reader sees a whole object or none.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path

import obstore
from obstore.exceptions import NotFoundError
from obstore.store import LocalStore, from_url

from cpn.core import errors
from cpn.core.settings import Settings

KEY_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{0,62}(/[A-Za-z0-9][A-Za-z0-9._\-]{0,127}){1,4}$")
CHUNK = 1 << 20


class BlobStore:
    @classmethod
    def of(cls, settings: Settings) -> BlobStore:
        """The server's store: ``CPN_BLOB_URL``, else ``<data_dir>/blobs``."""
        return cls(settings.blob_url or settings.data_dir / "blobs", settings.blob_max_bytes)

    def __init__(self, root: Path | str, max_bytes: int):
        """`root`: a directory (the default store) or an object-store URL."""
        self.max_bytes = max_bytes
        if isinstance(root, Path):
            root.mkdir(parents=True, exist_ok=True)
            self.root: Path | None = root
            self.store = LocalStore(root)
        else:
            self.root = None
            self.store = from_url(root)

    def _check(self, key: str) -> str:
        if not KEY_RE.match(key) or ".." in key:
            raise errors.InvalidInput(f"blob name {key!r} is not valid", field="name")
        return key

    def path(self, key: str) -> Path:
        """The file behind `key` in the default (disk) store."""
        if self.root is None:
            raise RuntimeError("this blob store is an object store, not a directory: use open()")
        return self.root / self._check(key)

    async def put(self, key: str, chunks: AsyncIterator[bytes]) -> int:
        """Store `chunks` under `key`; over `max_bytes` raises PayloadTooLarge and stores nothing."""
        self._check(key)
        size = 0

        async def limited() -> AsyncIterator[bytes]:
            nonlocal size
            async for chunk in chunks:
                size += len(chunk)
                if size > self.max_bytes:
                    raise errors.PayloadTooLarge(f"blob is larger than {self.max_bytes} bytes")
                yield chunk

        try:
            await obstore.put_async(self.store, key, limited())
        except errors.PayloadTooLarge:
            raise
        except Exception as exc:  # obstore wraps the iterator's exception: find ours
            cause = exc
            while cause is not None and not isinstance(cause, errors.PayloadTooLarge):
                cause = cause.__cause__ or cause.__context__
            if isinstance(cause, errors.PayloadTooLarge):
                raise cause from None
            if size > self.max_bytes:
                raise errors.PayloadTooLarge(f"blob is larger than {self.max_bytes} bytes") from None
            raise
        return size

    def exists(self, key: str) -> bool:
        try:
            obstore.head(self.store, self._check(key))
        except (NotFoundError, FileNotFoundError):
            return False
        return True

    def read_text(self, key: str) -> str:
        try:
            return bytes(obstore.get(self.store, self._check(key)).bytes()).decode()
        except (NotFoundError, FileNotFoundError) as exc:
            raise FileNotFoundError(key) from exc

    def list(self, prefix: str) -> list[str]:
        keys = [meta["path"] for batch in obstore.list(self.store, prefix.rstrip("/") + "/") for meta in batch]
        return sorted(k for k in keys if not k.rsplit("/", 1)[-1].startswith("."))

    def delete(self, keys: list[str]) -> int:
        """Remove `keys` (a missing one is no error); how many were asked. On the disk store, folders
        left empty go too, so a job's pruned checkpoint steps leave nothing behind."""
        for key in keys:
            self._check(key)
        for start in range(0, len(keys), 1000):
            try:
                obstore.delete(self.store, keys[start : start + 1000])
            except (NotFoundError, FileNotFoundError):  # one was gone already: the others one by one
                for key in keys[start : start + 1000]:
                    with contextlib.suppress(NotFoundError, FileNotFoundError):
                        obstore.delete(self.store, key)
        if self.root is not None:
            for folder in sorted({(self.root / k).parent for k in keys}, key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):  # not empty (another file, or a write in progress): kept
                    folder.rmdir()
        return len(keys)

    async def open(self, key: str) -> AsyncIterator[bytes] | None:
        """The object's bytes in chunks, or None when there is no such object."""
        try:
            result = await obstore.get_async(self.store, self._check(key))
        except (NotFoundError, FileNotFoundError):
            return None

        async def chunks() -> AsyncIterator[bytes]:
            async for chunk in result.stream(min_chunk_size=CHUNK):
                yield bytes(chunk)

        return chunks()
