"""One table of model presets: the runtime builds them, the service prices the same shapes."""

from __future__ import annotations

import pytest

from cpn.runtime.presets import ALIASES, PRESETS, PRICING_ONLY, TRAIN_SEQ_LEN, ModelConfig, resolve
from layers.service.schemas import MODEL_PRESETS, RUNNABLE_PRESETS, ModelSpec

# the published parameter counts of the real shapes
PUBLISHED = {"llama3-1b": 1.24e9, "llama3-8b": 8.03e9, "llama2-7b": 6.74e9, "llama2-13b": 13.0e9, "llama3-70b": 70.6e9}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_service_prices_the_preset_table(name: str) -> None:
    cfg = PRESETS[name]
    assert MODEL_PRESETS[name]["parameters"] == cfg.parameters
    assert MODEL_PRESETS[name]["layers"] == cfg.n_layers and MODEL_PRESETS[name]["hidden"] == cfg.d_model
    assert MODEL_PRESETS[name]["seqLen"] == TRAIN_SEQ_LEN[name] <= cfg.max_seq_len


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_shapes_have_their_published_size(name: str) -> None:
    assert PRESETS[name].parameters == pytest.approx(PUBLISHED[name], rel=0.01)


def test_the_cpu_presets_keep_their_sizes_and_the_old_names_stay_valid() -> None:
    sizes = {n: PRESETS[n].parameters for n in ("tiny", "small", "medium", "base", "large")}
    assert sizes == {"tiny": 132_864, "small": 891_648, "medium": 4_935_680, "base": 25_875_456,
                     "large": 100_214_784}  # what the benchmarks were recorded with
    assert all(PRESETS[n].arch == "gpt" for n in sizes) and PRESETS["llama-nano"].arch == "llama"
    assert 1e6 < PRESETS["llama-nano"].parameters < 10e6 and PRESETS["llama-nano"].vocab_size == 256
    assert {a: PRESETS[a] for a in ALIASES} == {a: PRESETS[t] for a, t in ALIASES.items()}
    xl = PRESETS["gpt2-xl"]
    assert (xl.arch, xl.n_layers, xl.d_model, xl.n_heads, xl.vocab_size, xl.max_seq_len) == ("gpt", 48, 1600, 25,
                                                                                          50_257, 1024)


def test_every_preset_is_runnable() -> None:
    assert PRICING_ONLY == {} and RUNNABLE_PRESETS == set(PRESETS)
    assert ModelSpec(preset="small").runnable and ModelSpec(preset="llama-7b").runnable
    with pytest.raises(ValueError, match="multiple of n_heads"):
        ModelConfig(d_model=65, n_heads=4)


def test_a_custom_shape_resolves_to_a_llama_config() -> None:
    cfg = resolve({"layers": 2, "hidden": 64, "heads": 4, "kvHeads": 2, "ffnHidden": 96, "vocab": 300, "seqLen": 32})
    assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden, cfg.vocab_size,
            cfg.max_seq_len, cfg.tie_embeddings) == ("llama", 2, 64, 4, 2, 96, 300, 32, False)
    assert resolve({"layers": 1, "hidden": 4096, "heads": 32, "vocab": 256, "seqLen": 8}).ffn_hidden == 11_008
    assert resolve("llama-7b") is PRESETS["llama2-7b"]


@pytest.mark.parametrize(("shape", "words"), [
    ({"layers": 2, "hidden": 64, "heads": 4, "vocab": 256}, "needs 'seqLen'"),
    ({"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seqLen": 8, "kv": 2}, "key 'kv' is not one of"),
    ({"layers": 2, "hidden": 64, "heads": 3, "vocab": 256, "seqLen": 8}, "hidden 64 must be a multiple of heads 3"),
    ({"layers": 2, "hidden": 64, "heads": 4, "kvHeads": 3, "vocab": 256, "seqLen": 8}, "multiple of kvHeads 3"),
    ({"layers": 0, "hidden": 64, "heads": 4, "vocab": 256, "seqLen": 8}, "'layers' must be at least 1"),
    ({"layers": "2", "hidden": 64, "heads": 4, "vocab": 256, "seqLen": 8}, "'layers' must be a number"),
])
def test_a_bad_custom_shape_names_the_key(shape: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        resolve(shape)
    with pytest.raises(ValueError, match="pick one of"):
        resolve("gigantic")
