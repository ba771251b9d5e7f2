"""The model presets: one table for the runtime (which builds and trains them) and the service
layer (which prices them). Pure data, no torch, so the API server can read it cheaply."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 512
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} must be a multiple of n_heads {self.n_heads}")

    @property
    def parameters(self) -> int:
        """Exactly what `TransformerLM(self)` holds (tied output embedding; checked by a test)."""
        d, hidden = self.d_model, self.mlp_ratio * self.d_model
        block = 2 * (2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (d * hidden + hidden) + (hidden * d + d)
        return self.vocab_size * d + self.max_seq_len * d + self.n_layers * block + 2 * d


# the byte-level LMs the runtime trains
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=256),
    "small": ModelConfig(d_model=128, n_layers=4, n_heads=4),
    "medium": ModelConfig(d_model=256, n_layers=6, n_heads=8),
    "base": ModelConfig(d_model=512, n_layers=8, n_heads=8, max_seq_len=1024),
    "large": ModelConfig(d_model=768, n_layers=14, n_heads=12, max_seq_len=1024),
}
# the sequence length a job of each preset trains with (and is priced at)
TRAIN_SEQ_LEN: dict[str, int] = {"tiny": 128, "small": 128, "medium": 256, "base": 512, "large": 1024}

# real-world sizes, priced for reference on real clusters; the runtime cannot train them
PRICING_ONLY: dict[str, dict[str, int]] = {
    "gpt2-xl": {"parameters": 1_500_000_000, "layers": 48, "hidden": 1600, "seqLen": 1024},
    "llama-7b": {"parameters": 6_700_000_000, "layers": 32, "hidden": 4096, "seqLen": 4096},
    "llama-13b": {"parameters": 13_000_000_000, "layers": 40, "hidden": 5120, "seqLen": 4096},
    "llama-70b": {"parameters": 70_000_000_000, "layers": 80, "hidden": 8192, "seqLen": 4096},
}


def shapes() -> dict[str, dict[str, int]]:
    """Every preset's shape as the compute model reads it, runnable ones first."""
    runnable = {name: {"parameters": cfg.parameters, "layers": cfg.n_layers, "hidden": cfg.d_model,
                       "seqLen": TRAIN_SEQ_LEN[name]} for name, cfg in PRESETS.items()}
    return {**runnable, **PRICING_ONLY}
