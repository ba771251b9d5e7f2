"""The corpus: real text every machine has, deterministic, with a fixed validation split and shards."""

from __future__ import annotations

import numpy as np
import torch

from cpn.runtime.data import ShardSampler, load_corpus, split_corpus, stdlib_files, val_batches


def test_corpus_is_the_stdlib_sources_deterministic_and_large_enough() -> None:
    corpus = load_corpus(8_000_000)
    assert len(corpus) == 8_000_000  # >= 5 MB
    assert np.array_equal(corpus, load_corpus(8_000_000))
    first = stdlib_files()[0].read_bytes()
    assert corpus[: len(first)].tobytes() == first
    text = corpus[:100_000].tobytes().decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    printable = np.isin(corpus[:1_000_000], np.frombuffer(b"\t\n\r" + bytes(range(32, 127)), dtype=np.uint8))
    assert printable.mean() > 0.98  # source code, not random bytes


def test_validation_split_is_the_held_out_tail() -> None:
    corpus = load_corpus(8_000_000)
    split = split_corpus(corpus)
    assert len(split.val) == len(corpus) - len(split.train)
    assert 0.04 < len(split.val) / len(corpus) < 0.06
    assert np.array_equal(split.val, corpus[-len(split.val) :])
    a = val_batches(split.val, seq_len=64, batches=3)
    b = val_batches(split.val, seq_len=64, batches=3)
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b, strict=True))
    x, y = a[0]
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_each_worker_reads_its_own_shard_deterministically() -> None:
    train = split_corpus(load_corpus(8_000_000)).train
    samplers = [ShardSampler(train, shard=i, num_shards=4, seq_len=64, seed=0) for i in range(4)]
    size = len(train) // 4
    for i, s in enumerate(samplers):
        assert np.shares_memory(s.data, train) and s.data.shape[0] == size
        assert s.data[0] == train[i * size]
    x1, _ = samplers[1].batch(step=5, batch_size=8)
    x2, _ = ShardSampler(train, shard=1, num_shards=4, seq_len=64, seed=0).batch(step=5, batch_size=8)
    assert torch.equal(x1, x2)
    assert not torch.equal(x1, samplers[1].batch(step=6, batch_size=8)[0])
    assert not torch.equal(x1, samplers[2].batch(step=5, batch_size=8)[0])
    assert x1.dtype == torch.int64 and x1.max() < 256


def _rows(t: torch.Tensor) -> list[tuple[int, ...]]:
    return sorted(map(tuple, t.tolist()))


def test_balanced_shares_deal_out_the_canonical_windows() -> None:
    """Uneven shares read exactly the windows of the equal layout (a full step and a trimmed one with a
    partial sequence), each once; equal shares read what each rank's own shard draw gives."""
    from cpn.runtime.config import trim_shares
    from cpn.runtime.data import canonical_picks

    train = np.random.default_rng(0).integers(0, 256, size=120_000).astype(np.uint8)
    seq, equal = 16, [11, 11, 10]
    samplers = [ShardSampler(train, shard=r, num_shards=3, seq_len=seq, seed=0) for r in range(3)]
    for r, sampler in enumerate(samplers):
        picks, drawn = canonical_picks([s * seq for s in equal], [s * seq for s in equal], r, seq)
        assert picks == [(r, i) for i in range(equal[r])]
        assert torch.equal(sampler.windows(4, picks, drawn)[0], sampler.batch(4, equal[r])[0])
    for canonical, units in (([s * seq for s in equal], [14 * seq, 13 * seq, 5 * seq]),
                             (trim_shares(20 * seq + 7, equal, seq), trim_shares(20 * seq + 7, [14, 13, 5], seq))):
        want = torch.cat([s.batch(7, c // seq + (1 if c % seq else 0))[0] for s, c in zip(samplers, canonical, strict=True)])
        got = [s.windows(7, *canonical_picks(units, canonical, r, seq))[0] for r, s in enumerate(samplers)]
        assert [len(g) for g in got] == [u // seq + (1 if u % seq else 0) for u in units]
        assert _rows(torch.cat(got)) == _rows(want)
