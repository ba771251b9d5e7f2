"""The transformer: preset sizes, causality, a sane initial loss, seeded initialisation."""

from __future__ import annotations

import math

import pytest
import torch

from cpn.runtime.model import PRESETS, ModelConfig, build_model, count_parameters


def test_presets_span_one_to_a_hundred_million_parameters() -> None:
    sizes = {name: count_parameters(build_model(name)) for name in ("tiny", "small", "medium")}
    assert sizes["tiny"] < 300_000  # the CI preset
    assert 0.7e6 <= sizes["small"] <= 1.5e6
    assert sizes["tiny"] < sizes["small"] < sizes["medium"]
    cfg = PRESETS["large"]  # not built: only the arithmetic (12 d^2 per layer + embeddings)
    approx = cfg.n_layers * 12 * cfg.d_model**2 + (cfg.vocab_size + cfg.max_seq_len) * cfg.d_model
    assert 80e6 <= approx <= 120e6


def test_logits_shape_and_initial_loss_near_uniform() -> None:
    model = build_model("tiny")
    x = torch.randint(0, 256, (2, 32))
    assert model(x).shape == (2, 32, 256)
    y = torch.randint(0, 256, (2, 32))
    assert model.loss(x, y).item() == pytest.approx(math.log(256), rel=0.05)


def test_attention_is_causal() -> None:
    model = build_model("tiny")
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    with torch.no_grad():
        assert torch.allclose(model(x)[0, :10], model(y)[0, :10], atol=1e-6)
        assert not torch.allclose(model(x)[0, 10:], model(y)[0, 10:])


def test_same_seed_same_weights_and_global_rng_untouched() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = build_model("tiny", seed=7), build_model("tiny", seed=7)
    assert torch.rand(1) == before
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(next(build_model("tiny", seed=8).parameters()), next(a.parameters()))


def test_bad_configs_say_how_to_fix() -> None:
    with pytest.raises(ValueError, match="multiple of n_heads"):
        ModelConfig(d_model=100, n_heads=3)
    with pytest.raises(ValueError, match="pick one of"):
        build_model("gigantic")
    with pytest.raises(ValueError, match="max_seq_len"):
        build_model("tiny")(torch.zeros(1, 300, dtype=torch.long))


@pytest.mark.parametrize("name", ["tiny", "llama-nano"])
def test_meta_build_then_init_weights_equals_the_cpu_build_for_both_archs(name: str) -> None:
    direct = build_model(name, seed=3)
    assert isinstance(direct.blocks, torch.nn.ModuleList) and direct.tok is direct.get_submodule("tok")
    with torch.device("meta"):
        lazy = build_model(PRESETS[name])
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    lazy.init_weights()
    assert all(torch.equal(a, b) for a, b in zip(direct.state_dict().values(), lazy.state_dict().values(), strict=True))
    assert count_parameters(direct) == PRESETS[name].parameters


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_built_on_the_meta_device_holds_its_stated_parameters(name: str) -> None:
    model = build_model(name, device="meta")
    assert count_parameters(model) == PRESETS[name].parameters
    assert len(model.blocks) == PRESETS[name].n_layers and model.tok.weight.shape == (PRESETS[name].vocab_size,
                                                                                       PRESETS[name].d_model)
