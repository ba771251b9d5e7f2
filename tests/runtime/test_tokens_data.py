"""Your tokens, the built-in model: a flat uint16/uint32 token file (a Dataset with format: tokens)
memory-mapped, split and sampled like the byte corpus; the model takes the dataset's vocabulary."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from cpn.core.manifest import ManifestLoader
from cpn.runtime.config import TrainConfig
from cpn.runtime.contract import AttemptSpec, CodeRef, DataRef, train_config
from cpn.runtime.data import ShardSampler, load_data, load_tokens, model_config, split_corpus, val_batches
from cpn.runtime.topology import Topology
from cpn.runtime.train import run_local
from layers.resource.datasets import DatasetManifest
from layers.service.schemas import TrainingJobSpec

EXAMPLE = Path(__file__).parents[2] / "examples" / "tokens"


def _make_tokens():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("make_tokens", EXAMPLE / "make_tokens.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_a_token_file_is_memory_mapped_in_the_width_its_vocabulary_needs(tmp_path: Path) -> None:
    ids = np.arange(10_000, dtype=np.uint32) * 7 % 70_000
    (tmp_path / "wide.bin").write_bytes(ids.astype("<u4").tobytes())
    wide = load_tokens(f"file://{tmp_path / 'wide.bin'}", 70_000)
    assert isinstance(wide, np.memmap) and wide.dtype == np.dtype("<u4") and np.array_equal(wide, ids)
    (tmp_path / "narrow.bin").write_bytes((ids % 500).astype("<u2").tobytes())
    narrow = load_tokens(str(tmp_path / "narrow.bin"), 500)
    assert narrow.dtype == np.dtype("<u2") and np.array_equal(narrow, ids % 500)
    x, y = ShardSampler(split_corpus(narrow).train, shard=1, num_shards=2, seq_len=32, seed=0).batch(0, 4)
    assert x.shape == (4, 32) and x.max() < 500 and np.array_equal(x[:, 1:], y[:, :-1])
    vx, _ = val_batches(split_corpus(narrow).val, seq_len=32, batches=1, batch_size=2)[0]
    assert vx.shape == (2, 32)


def test_a_token_file_that_does_not_match_its_vocabulary_is_refused_saying_why(tmp_path: Path) -> None:
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="not whole uint16 tokens"):
        load_tokens(str(tmp_path / "odd.bin"), 1000)
    (tmp_path / "big.bin").write_bytes(np.array([1, 2, 900], dtype="<u2").tobytes())
    with pytest.raises(ValueError, match="token id 900, outside data.vocab 512: set data.vocab to at least 901"):
        load_tokens(str(tmp_path / "big.bin"), 512)
    with pytest.raises(ValueError, match="no token file"):
        load_tokens(str(tmp_path / "missing.bin"), 512)
    with pytest.raises(ValueError, match="site's disk"):
        load_tokens("s3://bucket/tokens.bin", 512)


def test_the_config_states_the_vocabulary_and_the_model_takes_it() -> None:
    cfg = TrainConfig(model="llama-nano", data={"path": "/data/t.bin", "vocab": 32_000})
    assert cfg.data.format == "tokens" and model_config(cfg).vocab_size == 32_000
    assert model_config(cfg).parameters > model_config(TrainConfig(model="llama-nano")).parameters
    assert model_config(TrainConfig(model="tiny")).vocab_size == 256
    with pytest.raises(ValidationError, match="needs data.vocab"):
        TrainConfig(data={"format": "tokens", "path": "/data/t.bin"})
    with pytest.raises(ValidationError, match="are for data.format 'tokens'"):
        TrainConfig(data={"format": "bytes", "vocab": 300})
    with pytest.raises(ValueError, match="needs data.path"):
        load_data(TrainConfig(data={"format": "tokens", "vocab": 300}))


def test_the_contract_points_a_codeless_job_at_its_token_dataset() -> None:
    base = {"job": "alice/j", "attempt": 1, "subtask": "s0", "cluster": "c", "site_index": 0, "first_rank": 0,
            "workers": 1, "topology": Topology.uniform(1, 1), "train": TrainConfig(model="llama-nano"),
            "elastic": False}
    tokens = DataRef(dataset="toks", uri="file:///data/toks.bin", format="tokens", vocab=4096)
    cfg = train_config(AttemptSpec(**base, data=tokens))
    assert (cfg.data.format, cfg.data.vocab, cfg.data.path) == ("tokens", 4096, "file:///data/toks.bin")
    assert cfg.model == "llama-nano" and cfg.tokens == base["train"].tokens
    code = CodeRef(digest="sha256:" + "0" * 64, entrypoint="train:main")
    assert train_config(AttemptSpec(**base, data=tokens, code=code)).data.format == "bytes"  # the user's code reads it
    other = DataRef(dataset="text", uri="file:///data/x", format="jsonl")
    assert train_config(AttemptSpec(**base, data=other)).data.format == "bytes"


def test_the_example_dataset_and_job_validate() -> None:
    docs = list(yaml.load_all((EXAMPLE / "job.yaml").read_text(), Loader=ManifestLoader))
    dataset = DatasetManifest.model_validate(docs[0]).spec
    assert (dataset.format, dataset.vocab) == ("tokens", 4096)
    job = TrainingJobSpec.model_validate(docs[1]["spec"])
    assert job.dataset == docs[0]["metadata"]["name"] and job.model.preset == "llama-nano"  # type: ignore[union-attr]


@pytest.mark.slow
def test_llama_nano_trains_on_a_token_file_and_its_loss_falls(tmp_path: Path) -> None:
    about = _make_tokens().make(tmp_path / "tokens.bin", vocab=512, max_bytes=1_000_000)
    assert about["dtype"] == "uint16" and about["tokens"] > 200_000
    cfg = TrainConfig(model="llama-nano", data={"path": about["uri"], "vocab": 512}, tokens=24 * 2048,
                      global_batch_tokens=2048, seq_len=64, val_every=100, val_batches=2)
    summary = run_local(cfg, Topology.uniform(1, 1), run_dir=tmp_path / "run", timeout=300, start_method="forkserver")
    assert summary["initial_val_loss"] == pytest.approx(np.log(512), rel=0.05)  # a 512-way model, not 256
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0, summary
