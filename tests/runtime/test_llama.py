"""The llama arch: published sizes built on the meta device, grouped-query attention, rotary
positions, meta-device initialisation, and a pipeline cut that leaves the loss as it was."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cpn.runtime.model import LlamaLM, build_model, count_parameters, rotary
from cpn.runtime.presets import PRESETS, resolve
from cpn.runtime.stages import Stage, cut_model, unit_names
from tests.runtime.test_presets import PUBLISHED


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_shapes_built_on_the_meta_device_have_their_published_size(name: str) -> None:
    with torch.device("meta"):
        model = build_model(name)
    assert isinstance(model, LlamaLM) and model.tok.weight.is_meta
    assert count_parameters(model) == PRESETS[name].parameters
    assert count_parameters(model) == pytest.approx(PUBLISHED[name], rel=0.01)
    assert len(model.blocks) == PRESETS[name].n_layers
    assert (model.output is None) == (name == "llama3-1b")  # only the 1B ties its output to the token table


def test_meta_construction_then_init_weights_is_the_cpu_build() -> None:
    direct = build_model("llama-nano", seed=5)
    with torch.device("meta"):
        lazy = build_model("llama-nano")
    lazy.to_empty(device="cpu")
    torch.manual_seed(5)
    lazy.init_weights()
    assert all(torch.equal(a, b) for a, b in zip(direct.state_dict().values(), lazy.state_dict().values(), strict=True))
    assert not torch.equal(build_model("llama-nano", seed=6).tok.weight, direct.tok.weight)


def test_initial_loss_is_near_uniform_and_attention_is_causal() -> None:
    model = build_model("llama-nano")
    x = torch.randint(0, 256, (2, 64))
    assert model.loss(x, torch.randint(0, 256, (2, 64))).item() == pytest.approx(math.log(256), rel=0.05)
    y = x.clone()
    y[:, 40:] = (y[:, 40:] + 1) % 256
    with torch.no_grad():
        assert torch.allclose(model(x)[:, :40], model(y)[:, :40], atol=1e-5)
        assert not torch.allclose(model(x)[:, 40:], model(y)[:, 40:])


def test_grouped_query_attention_is_attention_with_repeated_key_value_heads() -> None:
    model = build_model(resolve({"layers": 1, "hidden": 64, "heads": 8, "kvHeads": 2, "vocab": 50, "seqLen": 16}))
    attn = model.blocks[0].attn
    x = torch.randn(2, 16, 64)
    b, t, _ = x.shape
    q = rotary(attn.wq(x).view(b, t, 8, 8).transpose(1, 2), attn.rope_theta)
    k = rotary(attn.wk(x).view(b, t, 2, 8).transpose(1, 2), attn.rope_theta).repeat_interleave(4, dim=1)
    v = attn.wv(x).view(b, t, 2, 8).transpose(1, 2).repeat_interleave(4, dim=1)
    ref = attn.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 64))
    assert torch.allclose(attn(x), ref, atol=1e-5)
    assert attn.wk.weight.shape == (16, 64)  # two key heads of 8, not eight


def test_rotary_makes_attention_scores_depend_on_relative_position_only() -> None:
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i: int, j: int) -> float:  # q at position i, k at position j, in a sequence of 12
        qs, ks = torch.zeros(1, 1, 12, 16), torch.zeros(1, 1, 12, 16)
        qs[..., i, :], ks[..., j, :] = q[..., 0, :], k[..., 0, :]
        return float((rotary(qs, 10_000.0)[..., i, :] * rotary(ks, 10_000.0)[..., j, :]).sum())

    assert score(5, 2) == pytest.approx(score(9, 6), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)
    assert torch.allclose(rotary(q, 10_000.0), q)  # position 0 is not turned


@pytest.mark.parametrize("tied", [False, True])
def test_a_two_stage_split_gives_the_whole_models_loss_and_gradients(tied: bool) -> None:
    cfg = PRESETS["llama-nano"] if not tied else resolve(
        {"layers": 3, "hidden": 64, "heads": 4, "kvHeads": 2, "vocab": 256, "seqLen": 32, "tieEmbeddings": True})
    model = build_model(cfg, seed=1)
    assert unit_names(model) == ["embed", *(f"block{i}" for i in range(cfg.n_layers)), "head"]
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    whole = model.loss(x, y)
    whole.backward()
    expected = {id(p): p.grad.clone() for p in model.parameters()}
    model.zero_grad()
    first, last = (Stage(model, cut) for cut in cut_model(model, 2))
    assert first.has_embed and last.has_head and first.ties_embedding == last.ties_embedding == tied
    staged = Stage.loss(last(first(x)), y)
    assert staged.item() == pytest.approx(whole.item(), abs=1e-6)
    staged.backward()
    assert all(torch.allclose(p.grad, expected[id(p)], atol=1e-6) for p in model.parameters())
    owned = {id(p) for p in first.owned_params()} | {id(p) for p in last.owned_params()}
    assert len(owned) == len(list(model.parameters()))  # every tensor held by exactly one owner


def test_a_runtime_config_takes_a_custom_shape_and_names_a_bad_key() -> None:
    from pydantic import ValidationError

    from cpn.runtime.autotune import _params
    from cpn.runtime.config import TrainConfig, auto_shard
    from cpn.runtime.data import model_config

    shape = {"layers": 2, "hidden": 64, "heads": 4, "kvHeads": 1, "vocab": 256, "seqLen": 128}
    cfg = TrainConfig(model=shape)
    assert count_parameters(build_model(model_config(cfg))) == resolve(shape).parameters == _params(cfg)
    assert auto_shard(shape, 2) == ("none", "none") and auto_shard("llama3-8b", 2) == ("site", "full")
    with pytest.raises(ValidationError, match="model shape needs 'heads'"):
        TrainConfig(model={"layers": 2, "hidden": 64, "vocab": 256, "seqLen": 128})
