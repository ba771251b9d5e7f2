"""The training corpus: the Python standard library's own sources, as byte tokens.

Every machine with a Python has it offline. Files are taken in sorted order (site-packages and the
test suite excluded) until ``max_bytes``, so the corpus is identical everywhere. The last
``val_fraction`` of the bytes is the fixed validation split; the rest is cut into one contiguous
shard per worker, or -- ``sampling="whole"``, ps_backup's default (see
:attr:`cpn.runtime.config.StrategyConfig.data_sampling`) -- every worker draws from all of it. Batches
are a pure function of (seed, rank, step), so a resumed run sees exactly the batches the
uninterrupted one would have seen.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cpn.runtime.config import Sampling

VAL_FRACTION = 0.05
_CACHE = Path(os.environ.get("CPN_CACHE_DIR", Path.home() / ".cache" / "cpn"))


_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def stdlib_files(root: str | None = None) -> list[Path]:
    """The standard library's .py files in sorted relative-path order (installed packages pruned)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def load_corpus(max_bytes: int = 8_000_000) -> np.ndarray:
    """The concatenated sources as uint8, cached on disk after the first read."""
    stdlib = sysconfig.get_paths()["stdlib"]
    key = hashlib.sha256(f"{max_bytes}:{stdlib}:{sys.version}".encode()).hexdigest()[:16]
    cached = _CACHE / f"corpus-{key}.bin"
    if cached.exists():
        return np.fromfile(cached, dtype=np.uint8)
    chunks, size = [], 0
    for path in stdlib_files(stdlib):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    corpus = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
    _CACHE.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    corpus.tofile(tmp)
    os.replace(tmp, cached)
    return corpus


@dataclass(frozen=True)
class Split:
    train: np.ndarray
    val: np.ndarray


def split_corpus(corpus: np.ndarray, val_fraction: float = VAL_FRACTION) -> Split:
    cut = int(len(corpus) * (1 - val_fraction))
    return Split(train=corpus[:cut], val=corpus[cut:])


class ShardSampler:
    """Random windows from one worker's contiguous shard, deterministic in (seed, shard, step).

    ``sampling="whole"``: the windows come from the whole training split instead (still keyed by
    ``shard``, the worker's rank, so workers draw different windows): i.i.d. draws from the data set,
    as strategies that drop some workers' gradients need."""

    def __init__(self, train: np.ndarray, *, shard: int, num_shards: int, seq_len: int, seed: int,
                 sampling: Sampling = "shard"):
        size = len(train) // num_shards
        self.data = train if sampling == "whole" else train[shard * size : (shard + 1) * size]
        if len(self.data) <= seq_len + 1:
            raise ValueError(f"shard of {len(self.data)} bytes is too small for seq_len {seq_len}: use fewer workers")
        self.seq_len, self.seed, self.shard = seq_len, seed, shard

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.shard, step])
        starts = rng.integers(0, len(self.data) - self.seq_len - 1, size=batch_size)
        return _windows(self.data, starts, self.seq_len)


def val_batches(val: np.ndarray, *, seq_len: int, batches: int, batch_size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of evenly spaced validation windows, the same on every rank and run."""
    starts = np.linspace(0, len(val) - seq_len - 2, batches * batch_size).astype(np.int64)
    return [_windows(val, starts[i * batch_size : (i + 1) * batch_size], seq_len) for i in range(batches)]


def _windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    block = torch.from_numpy(data[idx].astype(np.int64))
    return block[:, :-1], block[:, 1:]
