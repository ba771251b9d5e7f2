"""Code bundles: a user's directory as one content-addressed ``.tar.gz`` (stdlib only).

``cpnctl apply`` packs ``spec.code.path`` (:func:`pack`: sorted, owner and times zeroed, so the same
tree always gives the same sha256; ``.cpnignore`` and :data:`DEFAULT_IGNORE` leave files out). The
API server checks the archive's member list without extracting it (:func:`check_members`) and stores
it; it never imports or runs it. The site's job runner downloads it by digest, verifies the digest
and extracts it (:func:`extract`), refusing absolute paths, ``..``, links that leave the tree, device
files and FIFOs, and archives that unpack to more than ``max_unpacked`` bytes.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import os
import posixpath
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

IGNORE_FILE = ".cpnignore"
DEFAULT_IGNORE = (".git", ".hg", ".svn", "__pycache__", "*.pyc", ".venv", "venv", ".mypy_cache", ".pytest_cache",
                  ".ruff_cache", ".ipynb_checkpoints", ".DS_Store")
DIGEST_PREFIX = "sha256:"
UNPACK_FACTOR = 20  # an archive may unpack to at most this many times the bundle limit
# PAX extended headers and GNU long names/links together: tarfile reads each one whole into memory, and
# the member sizes do not count them (issue 35, H5: a 389 KB bundle with a 400 MB PAX comment, 1.5 GB)
MAX_HEADER_BYTES = 1 << 20
_LONG_HEADERS = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                 tarfile.GNUTYPE_LONGLINK)


class BundleError(ValueError):
    """A bundle that must not be stored or extracted; the message says which member and why."""


class BundleTooLarge(BundleError):
    pass


class BundleHeadersTooLarge(BundleError):
    """PAX or GNU long headers past MAX_HEADER_BYTES: a malformed bundle (422), not a big one (413)."""


def digest_of(data: bytes) -> str:
    return DIGEST_PREFIX + hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return DIGEST_PREFIX + h.hexdigest()


def _patterns(root: Path) -> list[str]:
    patterns = list(DEFAULT_IGNORE)
    ignore = root / IGNORE_FILE
    if ignore.is_file():
        for line in ignore.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                patterns.append(line.rstrip("/"))
    return patterns


def _ignored(rel: str, patterns: Iterable[str]) -> bool:
    parts = rel.split("/")
    for pattern in patterns:
        if "/" in pattern.strip("/"):
            if fnmatch.fnmatch(rel, pattern.strip("/")) or rel.startswith(pattern.strip("/") + "/"):
                return True
        elif any(fnmatch.fnmatch(p, pattern) for p in parts):
            return True
    return False


def files_of(root: Path) -> list[str]:
    """The relative paths :func:`pack` takes, sorted; symbolic links are refused."""
    if not root.is_dir():
        raise BundleError(f"{root} is not a directory")
    patterns = _patterns(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        dirnames[:] = sorted(d for d in dirnames if not _ignored(posixpath.normpath(f"{rel_dir}/{d}"), patterns))
        for name in sorted(filenames):
            rel = posixpath.normpath(f"{rel_dir}/{name}")
            if _ignored(rel, patterns):
                continue
            path = Path(dirpath, name)
            if path.is_symlink():
                raise BundleError(f"{rel} is a symbolic link: a bundle carries regular files only "
                                  f"(copy the file in, or list it in {IGNORE_FILE})")
            if path.is_file():
                out.append(rel)
    return sorted(out)


def pack(root: str | Path, max_bytes: int) -> tuple[bytes, str]:
    """(the .tar.gz, its ``sha256:`` digest); the same tree gives the same bytes."""
    root = Path(root)
    names = files_of(root)
    if not names:
        raise BundleError(f"{root} has no files to bundle (check {IGNORE_FILE})")
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w",
                                                                            format=tarfile.PAX_FORMAT) as tar:
        for rel in names:
            path = root / rel
            info = tarfile.TarInfo(rel)
            info.size = path.stat().st_size
            info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            info.mtime = 0
            with path.open("rb") as fh:
                tar.addfile(info, fh)
            if raw.tell() > max_bytes:
                break
    data = raw.getvalue()
    if len(data) > max_bytes:
        raise BundleTooLarge(f"bundle of {root} is over the limit of {max_bytes:,} bytes: leave large files out "
                             f"with {IGNORE_FILE} (data belongs in spec.dataset, not in the code)")
    return data, digest_of(data)


def _inside(name: str) -> bool:
    norm = posixpath.normpath(name)
    return not (name.startswith("/") or norm == ".." or norm.startswith("../") or "\\" in name
                or (len(name) > 1 and name[1] == ":"))


def check_member(member: tarfile.TarInfo) -> None:
    name = member.name
    if not _inside(name) or ".." in name.split("/"):
        raise BundleError(f"bundle member {name!r} points outside the bundle (absolute path or '..')")
    if member.ischr() or member.isblk() or member.isfifo() or member.isdev():
        raise BundleError(f"bundle member {name!r} is a device file or FIFO")
    if member.issym():
        target = posixpath.normpath(posixpath.join(posixpath.dirname(name), member.linkname))
        if member.linkname.startswith("/") or not _inside(target):
            raise BundleError(f"bundle member {name!r} links out of the bundle (to {member.linkname!r})")
    if member.islnk() and (not _inside(member.linkname) or ".." in member.linkname.split("/")):
        raise BundleError(f"bundle member {name!r} links out of the bundle (to {member.linkname!r})")
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        raise BundleError(f"bundle member {name!r} has an unsupported type")


class _CheckedTarInfo(tarfile.TarInfo):
    """Refuses PAX and GNU long headers past MAX_HEADER_BYTES in all before tarfile reads one into memory."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in _LONG_HEADERS:
            seen = getattr(tar, "_cpn_header_bytes", 0) + max(self.size, 0)
            tar._cpn_header_bytes = seen  # type: ignore[attr-defined]
            if seen > MAX_HEADER_BYTES:
                raise BundleHeadersTooLarge(f"bundle's extended (PAX or GNU long-name) headers hold more than "
                                     f"{MAX_HEADER_BYTES:,} bytes; no file name or attribute needs that many")
        return super()._proc_member(tar)  # type: ignore[misc]


class _Capped(io.RawIOBase):
    """The decompressed archive, refused past ``cap`` bytes: headers, padding and data alike."""

    def __init__(self, raw: IO[bytes], cap: int) -> None:
        self.raw, self.cap, self.seen = raw, cap, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        n = self.raw.readinto(buf)  # type: ignore[attr-defined]
        self.seen += n or 0
        if self.seen > self.cap:
            raise BundleTooLarge(f"bundle unpacks to more than {self.cap:,} bytes")
        return n or 0


def _open_capped(fileobj: IO[bytes], max_unpacked: int) -> tarfile.TarFile:
    cap = max_unpacked + MAX_HEADER_BYTES + (1 << 20)  # data, long headers, and the 512-byte blocks around them
    stream = io.BufferedReader(_Capped(gzip.GzipFile(fileobj=fileobj, mode="rb"), cap), tarfile.RECORDSIZE)
    return tarfile.open(fileobj=stream, mode="r|", tarinfo=_CheckedTarInfo)


def check_members(fileobj: IO[bytes], max_unpacked: int) -> int:
    """Walk the archive's headers (nothing is written or run); its member count. Raises BundleError."""
    total = count = 0
    try:
        with _open_capped(fileobj, max_unpacked) as tar:
            for member in tar:
                check_member(member)
                total += max(member.size, 0)
                count += 1
                if total > max_unpacked:
                    raise BundleTooLarge(f"bundle unpacks to more than {max_unpacked:,} bytes")
    except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile) as exc:
        raise BundleError(f"bundle is not a valid .tar.gz: {exc}") from None
    if count == 0:
        raise BundleError("bundle is empty")
    return count


def extract(archive: Path, dest: Path, max_unpacked: int, digest: str | None = None) -> Path:
    """Verify ``digest`` (when given), check every member, extract into ``dest`` (created; must not
    exist yet or be empty). Returns ``dest``."""
    if digest is not None and sha256_file(archive) != digest:
        raise BundleError(f"bundle digest mismatch: expected {digest}, got {sha256_file(archive)}")
    with archive.open("rb") as fh:
        check_members(fh, max_unpacked)
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    with tarfile.open(archive, mode="r:gz", tarinfo=_CheckedTarInfo) as tar:
        for member in tar.getmembers():
            check_member(member)  # again: the archive is the same bytes, but never trust one pass
            target = (root / member.name).resolve()
            if target != root and root not in target.parents:
                raise BundleError(f"bundle member {member.name!r} points outside the bundle")
        tar.extractall(root, filter="data")
    return dest
