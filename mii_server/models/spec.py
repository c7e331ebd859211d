"""ArchitectureSpec: the numbers a decoder-only model family needs, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArchitectureSpec:
    """Shape and options of a Llama-like decoder, independent of transformers' config classes."""

    model_type: str  # config.json's model_type
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when fewer than num_heads)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None or {"rope_type": "llama3" | "linear", ...}
    max_positions: int  # longest context the model was trained for (capped by a sliding window)
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 has biases on q, k and v
    eos_token_ids: tuple[int, ...]  # from config.json; the tokenizer's EOS is added by the caller

    @classmethod
    def from_hf_config(cls, config: Any, qkv_bias: bool = False) -> ArchitectureSpec:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        scaling = getattr(config, "rope_scaling", None) or rope or None
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        max_positions = config.max_position_embeddings
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True):
            # Attention within the window equals full attention; beyond it we do not yet mask.
            max_positions = min(max_positions, window)
        eos = getattr(config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=dict(scaling) if scaling else None,
            max_positions=max_positions,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            eos_token_ids=eos_ids,
        )
