"""One table of model presets: the runtime builds them, the service prices the same shapes."""

from __future__ import annotations

import pytest

from cpn.runtime.model import TransformerLM, count_parameters
from cpn.runtime.presets import PRESETS, PRICING_ONLY, TRAIN_SEQ_LEN, ModelConfig
from layers.service.schemas import MODEL_PRESETS, RUNNABLE_PRESETS, ModelSpec


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_priced_parameter_count_is_what_the_runtime_builds(name: str) -> None:
    cfg = PRESETS[name]
    assert count_parameters(TransformerLM(cfg)) == cfg.parameters == MODEL_PRESETS[name]["parameters"]
    assert MODEL_PRESETS[name]["layers"] == cfg.n_layers and MODEL_PRESETS[name]["hidden"] == cfg.d_model
    assert MODEL_PRESETS[name]["seqLen"] == TRAIN_SEQ_LEN[name] <= cfg.max_seq_len


def test_runnable_and_pricing_only_presets_are_told_apart() -> None:
    assert RUNNABLE_PRESETS == set(PRESETS) and not RUNNABLE_PRESETS & set(PRICING_ONLY)
    assert ModelSpec(preset="small").runnable and not ModelSpec(preset="llama-7b").runnable
    with pytest.raises(ValueError, match="multiple of n_heads"):
        ModelConfig(d_model=65, n_heads=4)
