"""CPN's built-in decoder-only language models, one per :class:`~cpn.runtime.presets.ModelConfig` arch.

- ``gpt`` (:class:`TransformerLM`): the byte LMs ``tiny`` … ``large``: pre-norm LayerNorm blocks,
  learned positions, GELU MLP, tied input/output embeddings (~0.1 M to ~100 M parameters);
- ``llama`` (:class:`LlamaLM`): RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no
  biases, optionally tied embeddings: ``llama-nano`` up to the published 70 B shape.

Both expose what the runtime's sharding, pipeline and checkpointing rely on: ``blocks`` (an
``nn.ModuleList``, the FSDP / activation-checkpointing unit, each called as ``block(x)``), ``tok`` (the
input embedding), ``embed(idx)`` / ``head(x)`` around the blocks, ``loss(x, y)``, and meta-device
construction: ``with torch.device("meta"): m = build_model(cfg)``, then ``m.to_empty(device=...)`` and,
after ``torch.manual_seed(seed)``, ``m.init_weights()`` gives the weights ``build_model(cfg, seed=seed)``
gives on the CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cpn.runtime.presets import PRESETS, ModelConfig, resolve

__all__ = ["PRESETS", "LlamaLM", "ModelConfig", "TransformerLM", "build_model", "count_parameters"]


class _LM(nn.Module):
    """What both archs share: the sequence-length check, the blocks in order, the loss."""

    cfg: ModelConfig
    tok: nn.Embedding
    blocks: nn.ModuleList

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embed_params(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def head_params(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def init_weights(self) -> None:
        raise NotImplementedError

    @property
    def tied(self) -> nn.Parameter | None:
        """The token table when the output projection is the same tensor (None when untied)."""
        return self.tok.weight if self.cfg.tie_embeddings else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds the preset's max_seq_len {self.cfg.max_seq_len}")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


# ---- gpt ---------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TransformerLM(_LM):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.arch != "gpt":
            raise ValueError(f"TransformerLM builds the gpt arch, not {cfg.arch!r}: use build_model(cfg)")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        if not self.tok.weight.is_meta:
            self._init_gpt2()

    def init_weights(self) -> None:
        """The weights the constructor draws from the same RNG state: every module's own default
        initialisation in construction order (what ``nn.Linear`` etc. draw when built), then GPT-2's."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        self._init_gpt2()

    def _init_gpt2(self) -> None:
        self.apply(self._init)
        for block in self.blocks:  # scale residual projections by depth (GPT-2)
            for proj in (block.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.cfg.n_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x) @ self.tok.weight.T

    def embed_params(self) -> list[nn.Parameter]:
        return [self.tok.weight, self.pos.weight]

    def head_params(self) -> list[nn.Parameter]:
        return [*self.ln_f.parameters(), self.tok.weight]


# ---- llama -------------------------------------------------------------------------------------


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, heads, seq, head_dim): each pair of channels
    (2i, 2i+1) at position p turned by the angle p·θ^(-2i/head_dim). Computed per call in fp32 (a
    few thousand sines, nothing beside the matmuls), so the model holds no position buffers that
    meta-device construction, sharding or a checkpoint would have to carry."""
    t, dim = x.shape[-2], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    pairs = x.float().unflatten(-1, (dim // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention: ``n_kv_heads`` key/value heads, each serving
    ``n_heads / n_kv_heads`` query heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, int(cfg.n_kv_heads or cfg.n_heads), cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotary(q, self.rope_theta), rotary(k, self.rope_theta)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(att.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = int(cfg.ffn_hidden or 0)
        self.w1 = nn.Linear(cfg.d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, cfg.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LlamaLM(_LM):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.arch != "llama":
            raise ValueError(f"LlamaLM builds the llama arch, not {cfg.arch!r}: use build_model(cfg)")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if not self.tok.weight.is_meta:
            self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, 0.02) weights, the residual projections (``wo``, ``w2``) scaled by 1/√(2·layers)
        (GPT-2's rule), unit norm weights; drawn in module order from the global RNG."""
        std, residual = 0.02, 0.02 / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.tok.weight, std=std)
        for block in self.blocks:
            for norm in (block.attn_norm, block.mlp_norm):
                norm.reset_parameters()
            for linear in (block.attn.wq, block.attn.wk, block.attn.wv, block.mlp.w1, block.mlp.w3):
                nn.init.normal_(linear.weight, std=std)
            for linear in (block.attn.wo, block.mlp.w2):
                nn.init.normal_(linear.weight, std=residual)
        self.norm.reset_parameters()
        if self.output is not None:
            nn.init.normal_(self.output.weight, std=std)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        return self.output(x) if self.output is not None else x @ self.tok.weight.T

    def embed_params(self) -> list[nn.Parameter]:
        return [self.tok.weight]

    def head_params(self) -> list[nn.Parameter]:
        return [*self.norm.parameters(), self.output.weight if self.output is not None else self.tok.weight]


ARCH_CLASSES: dict[str, type[_LM]] = {"gpt": TransformerLM, "llama": LlamaLM}


def build_model(model: str | dict | ModelConfig, *, seed: int = 0,
                device: torch.device | str | None = None) -> TransformerLM | LlamaLM:
    """The model of a preset name, a custom shape or a :class:`ModelConfig`.

    Every rank builds the same initial weights from the seed, so no initial broadcast is needed. The
    weights are drawn on the host (the CPU generator is the same everywhere, so a GPU site and a CPU
    site start alike) and then moved to ``device`` (None: torch's default device). On the meta device
    (``device="meta"``, or inside ``with torch.device("meta")``) nothing is allocated or drawn: call
    ``to_empty`` and ``init_weights`` on the result."""
    cfg = resolve(model)
    cls = ARCH_CLASSES[cfg.arch]
    target = torch.device(device) if device is not None else torch.get_default_device()
    with torch.device("meta"):
        built = cls(cfg)
    if target.type == "meta":
        return built  # type: ignore[return-value]
    built.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(seed)
        built.init_weights()
    return built.to(target)  # type: ignore[return-value]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
