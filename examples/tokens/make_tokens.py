"""Write a small token file for the `format: tokens` example: a flat little-endian uint16 file of token ids.

Any tokenizer's output will do (nanoGPT's `prepare.py` and torchtitan write the same layout); this one
makes its own without a download: the standard library's Python sources (CPN's byte corpus), cut into
words, spaces and punctuation, each piece one token id among the `vocab - 1` most frequent (id 0 for
the rest). Run it, then `cpnctl apply -f examples/tokens/job.yaml`, or train locally:

    python examples/tokens/make_tokens.py --out /tmp/cpn-tokens/tokens.bin
    cpn train --model llama-nano --data /tmp/cpn-tokens/tokens.bin --vocab 4096 --sites 2 --workers-per-site 1
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np

PIECE = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*|[0-9]+| +|\n|.", re.DOTALL)
DEFAULT_OUT = Path("/tmp/cpn-tokens/tokens.bin")  # where the example's Dataset says the replica lives


def tokenize(text: bytes, vocab: int) -> tuple[np.ndarray, list[bytes]]:
    """Token ids of ``text`` (uint16 below 65536 ids, else uint32) and the pieces they stand for (id 0: any other)."""
    pieces = PIECE.findall(text)
    table = [b"<unk>", *(p for p, _ in Counter(pieces).most_common(vocab - 1))]
    ids = {p: i for i, p in enumerate(table)}
    dtype = np.uint16 if vocab <= 65_536 else np.uint32
    return np.fromiter((ids.get(p, 0) for p in pieces), dtype=dtype, count=len(pieces)), table


def make(out: Path = DEFAULT_OUT, *, vocab: int = 4096, max_bytes: int = 4_000_000) -> dict:
    """Write ``out`` (and ``out``.json: how it was made); returns that description."""
    from cpn.runtime.data import load_corpus

    tokens, table = tokenize(load_corpus(max(max_bytes, 1_000_000))[:max_bytes].tobytes(), vocab)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens.astype(tokens.dtype.newbyteorder("<")).tofile(out)
    about = {"tokens": len(tokens), "vocab": vocab, "dtype": tokens.dtype.name, "bytes": out.stat().st_size,
             "sizeGB": out.stat().st_size / 1e9, "unknown": float((tokens == 0).mean()), "uri": out.resolve().as_uri()}
    out.with_suffix(".json").write_text(json.dumps({**about, "pieces": [p.decode("latin-1") for p in table]}))
    return about


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--max-bytes", type=int, default=4_000_000, help="bytes of source text to tokenize")
    args = parser.parse_args()
    print(json.dumps(make(args.out, vocab=args.vocab, max_bytes=args.max_bytes)))
