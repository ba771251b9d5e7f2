"""The model presets: one table for the runtime (which builds and trains them) and the service
layer (which prices them). Pure data, no torch, so the API server can read it cheaply.

Two architectures share one :class:`ModelConfig`:

- ``gpt``: CPN's original byte LMs (``tiny`` … ``large``): pre-norm LayerNorm blocks with biases,
  learned positions, GELU MLP, tied input/output embeddings;
- ``llama``: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases, optionally
  tied embeddings: ``llama-nano`` (CPU-sized, byte vocabulary) and the published shapes
  ``llama3-1b``, ``llama3-8b``, ``llama2-7b``, ``llama2-13b``, ``llama3-70b``.

A job may also give a custom shape (``resolve`` of a dict, the API's camelCase keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Arch = Literal["gpt", "llama"]
ARCHS: tuple[str, ...] = ("gpt", "llama")


def llama_ffn_hidden(d_model: int, multiple_of: int = 256) -> int:
    """Llama's default SwiGLU width: 2/3 of 4·d, rounded up to ``multiple_of``."""
    hidden = int(2 * 4 * d_model / 3)
    return multiple_of * -(-hidden // multiple_of)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    arch: Arch = "gpt"
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 512
    mlp_ratio: int = 4  # gpt: MLP width = mlp_ratio · d_model
    n_kv_heads: int | None = None  # llama: key/value heads (grouped-query attention); None: n_heads
    ffn_hidden: int | None = None  # llama: SwiGLU width; None: llama_ffn_hidden(d_model). gpt: mlp_ratio · d_model
    tie_embeddings: bool | None = None  # None: True for gpt (always tied), False for llama
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch {self.arch!r} is not one of {list(ARCHS)}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be at least 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} must be a multiple of n_heads {self.n_heads}")
        gpt = self.arch == "gpt"
        kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        ffn = (self.mlp_ratio * self.d_model if gpt else llama_ffn_hidden(self.d_model)) \
            if self.ffn_hidden is None else self.ffn_hidden
        tie = gpt if self.tie_embeddings is None else self.tie_embeddings
        object.__setattr__(self, "n_kv_heads", kv)
        object.__setattr__(self, "ffn_hidden", ffn)
        object.__setattr__(self, "tie_embeddings", tie)
        if gpt:
            if kv != self.n_heads or ffn != self.mlp_ratio * self.d_model or not tie:
                raise ValueError("the gpt arch has n_kv_heads = n_heads, ffn_hidden = mlp_ratio · d_model and tied "
                                 "embeddings: drop those fields, or use arch='llama'")
            return
        if kv < 1 or self.n_heads % kv:
            raise ValueError(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {kv} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim d_model/n_heads = {self.head_dim} must be even for rotary embeddings: "
                             "change d_model or n_heads")
        if ffn < 1:
            raise ValueError(f"ffn_hidden {ffn} must be at least 1")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def parameters(self) -> int:
        """Exactly what ``build_model(self)`` holds (checked by a test, for both archs)."""
        d, v = self.d_model, self.vocab_size
        ffn, kv_dim = int(self.ffn_hidden or 0), int(self.n_kv_heads or 0) * self.head_dim
        if self.arch == "gpt":  # LayerNorms and Linears with biases; tied output; learned positions
            block = 2 * (2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (d * ffn + ffn) + (ffn * d + d)
            return v * d + self.max_seq_len * d + self.n_layers * block + 2 * d
        attention = d * d + 2 * d * kv_dim + d * d  # wq, wk, wv, wo (no biases)
        block = attention + 3 * d * ffn + 2 * d  # SwiGLU w1, w2, w3 and two RMSNorm weights
        embeddings = v * d * (1 if self.tie_embeddings else 2)
        return embeddings + self.n_layers * block + d


_NANO = ModelConfig(arch="llama", vocab_size=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=704,
                    max_seq_len=256)
_LLAMA3 = {"arch": "llama", "vocab_size": 128_256, "rope_theta": 500_000.0, "max_seq_len": 8192}
_LLAMA2 = {"arch": "llama", "vocab_size": 32_000, "rope_theta": 10_000.0, "max_seq_len": 4096}

# every model the runtime builds: the byte-level LMs it trains on a CPU, and the published shapes
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=256),
    "small": ModelConfig(d_model=128, n_layers=4, n_heads=4),
    "medium": ModelConfig(d_model=256, n_layers=6, n_heads=8),
    "base": ModelConfig(d_model=512, n_layers=8, n_heads=8, max_seq_len=1024),
    "large": ModelConfig(d_model=768, n_layers=14, n_heads=12, max_seq_len=1024),
    "llama-nano": _NANO,
    # Llama 3.2 1B (its rope scaling for long contexts is not modelled), Llama 3 8B / 70B, Llama 2 7B / 13B
    "llama3-1b": ModelConfig(**_LLAMA3, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
                             tie_embeddings=True),
    "llama3-8b": ModelConfig(**_LLAMA3, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14_336),
    "llama2-7b": ModelConfig(**_LLAMA2, d_model=4096, n_layers=32, n_heads=32, ffn_hidden=11_008),
    "llama2-13b": ModelConfig(**_LLAMA2, d_model=5120, n_layers=40, n_heads=40, ffn_hidden=13_824),
    "llama3-70b": ModelConfig(**_LLAMA3, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28_672),
    "gpt2-xl": ModelConfig(vocab_size=50_257, d_model=1600, n_layers=48, n_heads=25, max_seq_len=1024),
}
# the names earlier releases priced, kept valid: each is the shape it always meant
ALIASES: dict[str, str] = {"llama-7b": "llama2-7b", "llama-13b": "llama2-13b", "llama-70b": "llama3-70b"}
PRESETS.update({alias: PRESETS[target] for alias, target in ALIASES.items()})

# the sequence length a job of each preset trains with (and is priced at)
TRAIN_SEQ_LEN: dict[str, int] = {"tiny": 128, "small": 128, "medium": 256, "base": 512, "large": 1024,
                                 "llama-nano": 128, "llama3-1b": 8192, "llama3-8b": 8192, "llama2-7b": 4096,
                                 "llama2-13b": 4096, "llama3-70b": 8192, "gpt2-xl": 1024}
TRAIN_SEQ_LEN.update({alias: TRAIN_SEQ_LEN[target] for alias, target in ALIASES.items()})

# nothing is priced for reference only any more: what CPN can build, it can run (kept importable)
PRICING_ONLY: dict[str, dict[str, int]] = {}

# a custom shape's keys (the API's camelCase) and the ModelConfig field each sets
CUSTOM_KEYS: dict[str, str] = {"layers": "n_layers", "hidden": "d_model", "heads": "n_heads", "kvHeads": "n_kv_heads",
                               "ffnHidden": "ffn_hidden", "vocab": "vocab_size", "seqLen": "max_seq_len",
                               "tieEmbeddings": "tie_embeddings", "ropeTheta": "rope_theta"}
_REQUIRED = ("layers", "hidden", "heads", "vocab", "seqLen")


def resolve(model: str | dict[str, Any] | ModelConfig) -> ModelConfig:
    """A preset's name, or a custom llama shape ``{layers, hidden, heads, kvHeads, ffnHidden, vocab,
    seqLen}`` (optional: ``kvHeads`` = heads, ``ffnHidden`` = Llama's 8/3·hidden rounded to 256,
    ``tieEmbeddings`` = false, ``ropeTheta`` = 10000), as a :class:`ModelConfig`. A ValueError names
    the bad key and the fix."""
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, str):
        if model not in PRESETS:
            raise ValueError(f"unknown model preset {model!r}: pick one of {sorted(PRESETS)}, or give a shape "
                             f"{{{', '.join(_REQUIRED)}}}")
        return PRESETS[model]
    if not isinstance(model, dict):
        raise ValueError(f"a model is a preset name or a shape dict, not a {type(model).__name__}")
    unknown = sorted(set(model) - set(CUSTOM_KEYS))
    if unknown:
        raise ValueError(f"model shape key {unknown[0]!r} is not one of {list(CUSTOM_KEYS)}: rename or drop it")
    missing = [k for k in _REQUIRED if model.get(k) is None]
    if missing:
        raise ValueError(f"model shape needs {missing[0]!r} (all of {list(_REQUIRED)}): add it")
    for key, value in model.items():
        kind = bool if key == "tieEmbeddings" else float if key == "ropeTheta" else int
        ok = isinstance(value, bool) if kind is bool else (
            isinstance(value, int | float) and not isinstance(value, bool) and (kind is float or value == int(value)))
        if value is not None and not ok:
            raise ValueError(f"model shape {key!r} must be {'a boolean' if kind is bool else 'a number'}, "
                             f"got {value!r}")
        if value is not None and kind is int and value < 1:
            raise ValueError(f"model shape {key!r} must be at least 1, got {value!r}")
    kwargs = {CUSTOM_KEYS[k]: (v if CUSTOM_KEYS[k] in ("tie_embeddings", "rope_theta") else int(v))
              for k, v in model.items() if v is not None}
    try:
        return ModelConfig(arch="llama", **kwargs)
    except ValueError as exc:
        raise ValueError(_camel(str(exc))) from exc


def _camel(message: str) -> str:
    """A ModelConfig message in the API's words (``d_model`` → ``hidden``, …)."""
    for key, field in sorted(CUSTOM_KEYS.items(), key=lambda kv: -len(kv[1])):
        message = message.replace(field, key)
    return message


def shape_of(cfg: ModelConfig, seq_len: int | None = None) -> dict[str, int]:
    """What the compute model reads of a model: parameters, layers, hidden, the trained sequence length."""
    return {"parameters": cfg.parameters, "layers": cfg.n_layers, "hidden": cfg.d_model,
            "seqLen": seq_len or cfg.max_seq_len}


def shapes() -> dict[str, dict[str, int]]:
    """Every preset's shape as the compute model reads it."""
    return {name: shape_of(cfg, TRAIN_SEQ_LEN[name]) for name, cfg in PRESETS.items()}

