"""The training corpus: the Python standard library's own sources, as byte tokens.

Every machine with a Python has it offline. Files are taken in sorted order (site-packages and the
test suite excluded) until ``max_bytes``, so the corpus is identical everywhere. The last
``val_fraction`` of the bytes is the fixed validation split; the rest is cut into one contiguous
shard per worker, or -- ``sampling="whole"``, ps_backup's default (see
:attr:`cpn.runtime.config.StrategyConfig.data_sampling`) -- every worker draws from all of it. Batches
are a pure function of (seed, rank, step), so a resumed run sees exactly the batches the
uninterrupted one would have seen.

Or the user's own tokens (``data.format: tokens``, a Dataset with ``format: tokens``): a flat
little-endian uint16 (vocabularies up to 65536) or uint32 file of token ids, as nanoGPT and torchtitan
write them, memory-mapped (a file larger than memory trains), split and sampled the same way; the
model's vocabulary is the dataset's (:func:`model_config`).
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from cpn.runtime.config import Sampling, TrainConfig, token_dtype
from cpn.runtime.presets import ModelConfig, resolve

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


_CHECKED_TOKENS = 1 << 20  # ids read to check a token file against its vocabulary (its head and a stride)


def token_file(uri: str) -> Path:
    """The local file of a token dataset's URI: a path, ``file:rel``, or ``file:///abs``."""
    if uri.startswith("file://"):
        return Path(uri[len("file://"):])
    if uri.startswith("file:"):
        return Path(uri[len("file:"):])
    if "://" in uri:
        raise ValueError(f"data.path {uri!r}: the built-in model reads token files on the site's disk (a path or "
                         "a file: URI); list a replica at a path the site's workers can read")
    return Path(uri)


def load_tokens(uri: str, vocab: int) -> np.ndarray:
    """The token file at ``uri``, memory-mapped as little-endian uint16 (``vocab`` <= 65536) or uint32;
    a file that is not whole tokens, or holds ids >= ``vocab``, is refused saying which."""
    path = token_file(uri)
    if not path.is_file():
        raise ValueError(f"data.path {uri!r}: no token file at {path}")
    dtype = np.dtype(token_dtype(vocab)).newbyteorder("<")
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise ValueError(f"data.path {uri!r} holds {size} bytes, not whole {dtype.name} tokens (vocab {vocab} "
                         f"means {dtype.itemsize}-byte ids): check data.vocab, or write the file as {dtype.name}")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    stride = max(1, len(tokens) // _CHECKED_TOKENS)
    seen = max(int(tokens[:_CHECKED_TOKENS].max()), int(tokens[::stride].max()))
    if seen >= vocab:
        raise ValueError(f"data.path {uri!r} holds token id {seen}, outside data.vocab {vocab}: "
                         f"set data.vocab to at least {seen + 1}")
    return tokens


def load_data(cfg: TrainConfig) -> np.ndarray:
    """The job's data as one flat array of token ids: the byte corpus, or the memory-mapped token file."""
    if cfg.data.format == "tokens":
        if cfg.data.path is None:
            raise ValueError("data.format 'tokens' needs data.path: in a job, a Dataset replica at the site; "
                             "with cpn train, --data FILE")
        return load_tokens(cfg.data.path, int(cfg.data.vocab or 0))
    return load_corpus(cfg.corpus_bytes)


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The built-in model of ``cfg``: its preset, with the token dataset's vocabulary."""
    model = resolve(cfg.model)
    if cfg.data.format == "tokens" and cfg.data.vocab != model.vocab_size:
        model = replace(model, vocab_size=int(cfg.data.vocab or 0))
    return model


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
    as strategies that drop some workers' gradients need.

    :meth:`windows` reads a step's windows by their place in the *canonical* layout (equal shares,
    what ddp's ranks read): throughput-proportional shares then change which rank computes a window,
    never which windows the step learns from."""

    def __init__(self, train: np.ndarray, *, shard: int, num_shards: int, seq_len: int, seed: int,
                 sampling: Sampling = "shard"):
        self.train, self.sampling = train, sampling
        self.shard_bytes = len(train) // num_shards  # one contiguous shard's length (``sampling="shard"``)
        start = self._offset(shard)
        self.data = train if sampling == "whole" else train[start : start + self.shard_bytes]
        if len(self.data) <= seq_len + 1:
            raise ValueError(f"shard of {len(self.data)} bytes is too small for seq_len {seq_len}: use fewer workers")
        self.seq_len, self.seed, self.shard = seq_len, seed, shard

    def _offset(self, shard: int) -> int:
        """Where ``shard``'s data begins in the training split (0 for ``sampling="whole"``)."""
        return 0 if self.sampling == "whole" else shard * self.shard_bytes

    def _starts(self, shard: int, step: int, count: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, shard, step])
        return rng.integers(0, len(self.data) - self.seq_len - 1, size=count)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _windows(self.data, self._starts(self.shard, step, batch_size), self.seq_len)

    def windows(self, step: int, picks: list[tuple[int, int]], drawn: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows ``picks`` = [(shard q, index i), …] of ``step``: window i of the ``drawn[q]``
        that shard q's rank draws in that step (:meth:`batch` on shard q; see :func:`canonical_picks`).
        Picks of this rank's own shard alone, in order, are :meth:`batch`."""
        draws = {q: self._offset(q) + self._starts(q, step, drawn[q]) for q in {q for q, _ in picks}}
        starts = np.array([draws[q][i] for q, i in picks], dtype=np.int64)
        return _windows(self.train, starts, self.seq_len)


def canonical_picks(units: list[int], canonical: list[int], rank: int, seq_len: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Which windows of a step ``rank`` computes when the ranks hold ``units`` tokens each, while the
    step's windows are those of the ``canonical`` layout (each rank q of equal shares reads its whole
    sequences and, in a trimmed step, one partial one from shard q). The canonical whole windows are
    dealt out in rank order by ``units``; the partial window (a trimmed step's tail) goes with the tail.
    Returns ``(picks, drawn)``: [(shard, index)] and how many windows each shard's draw holds."""
    whole = [(q, i) for q, c in enumerate(canonical) for i in range(c // seq_len)]
    drawn = [c // seq_len + (1 if c % seq_len else 0) for c in canonical]
    full = [u // seq_len for u in units]
    if sum(full) != len(whole):
        raise ValueError(f"the ranks' {sum(full)} whole sequences are not the canonical {len(whole)}")
    start = sum(full[:rank])
    picks = whole[start : start + full[rank]]
    if units[rank] % seq_len:
        owner = next(q for q, c in enumerate(canonical) if c % seq_len)
        picks.append((owner, canonical[owner] // seq_len))
    return picks, drawn


def val_batches(val: np.ndarray, *, seq_len: int, batches: int, batch_size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of evenly spaced validation windows, the same on every rank and run."""
    starts = np.linspace(0, len(val) - seq_len - 2, batches * batch_size).astype(np.int64)
    return [_windows(val, starts[i * batch_size : (i + 1) * batch_size], seq_len) for i in range(batches)]


def _windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    block = torch.from_numpy(data[idx].astype(np.int64))
    return block[:, :-1], block[:, 1:]
