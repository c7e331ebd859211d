"""ArchitectureSpec: the numbers a decoder-only model family needs, read from a Hugging Face config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


def _first(config: Any, names: tuple[str, ...], default: Any = None) -> Any:
    """The first of ``names`` the config sets (families name the same number differently)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


@dataclass(frozen=True)
class MoESpec:
    """The routed experts of a mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # of each expert
    normalize_topk: bool  # renormalise the top-k router probabilities to sum to 1
    shared_intermediate_size: int  # Qwen2-MoE's sigmoid-gated shared expert; 0 when there is none
    dense_layers: tuple[int, ...]  # layers that keep a plain MLP (mlp_only_layers, decoder_sparse_step)

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @classmethod
    def from_hf_config(cls, config: Any, num_layers: int) -> MoESpec | None:
        """None for a dense model."""
        experts = _first(config, ("num_local_experts", "num_experts"), 0)
        if not experts:
            return None
        step = getattr(config, "decoder_sparse_step", 1) or 1
        only_mlp = set(getattr(config, "mlp_only_layers", None) or ())
        return cls(
            num_experts=experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=_first(config, ("moe_intermediate_size", "intermediate_size")),
            # Mixtral always renormalises (its config has no norm_topk_prob)
            normalize_topk=bool(getattr(config, "norm_topk_prob", True)),
            shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
            dense_layers=tuple(i for i in range(num_layers) if i in only_mlp or (i + 1) % step),
        )


@dataclass(frozen=True)
class ArchitectureSpec:
    """Shape and options of a decoder, independent of transformers' config classes."""

    model_type: str  # config.json's model_type
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the (dense) MLP
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when fewer than num_heads)
    head_dim: int
    rms_norm_eps: float  # epsilon of the model's norms (RMSNorm or LayerNorm)
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None or {"rope_type": "llama3" | "linear", ...}
    max_positions: int  # longest context the model was trained for
    tie_word_embeddings: bool
    qkv_bias: bool  # biases on q, k and v (Qwen2; attention_bias; Phi, OPT)
    eos_token_ids: tuple[int, ...]  # from config.json; the tokenizer's EOS is added by the caller
    o_bias: bool = False  # a bias on the attention's output projection
    mlp_bias: bool = False  # biases on the MLP's projections
    hidden_act: str = "silu"  # the MLP's activation, as transformers names it
    rotary_dim: int = 0  # leading dimensions of each head that rotary rotates; 0: no rotary (OPT)
    attention_scale: float = 0.0  # softmax scale of q.k (head_dim ** -0.5 unless the model says)
    attn_logit_softcap: float = 0.0  # Gemma 2: logits s -> c * tanh(s / c); 0: none
    final_logit_softcap: float = 0.0  # Gemma 2: the same on the LM head's logits
    sliding_windows: tuple[int, ...] = ()  # per layer: keys a token sees (itself included); 0: all
    qk_norm: str = ""  # per-head norm of q and k before rotary: "rms" (Qwen3), "layer" (Phi), "": none
    parallel_block_norms: int = 0  # attention and MLP side by side on one input (Phi, Falcon), with
    # this many norms (1: shared, 2: one each); 0: the sequential block (attention, then MLP)
    moe: MoESpec | None = None  # routed experts; None for a dense model

    def sliding_window(self, layer: int) -> int:
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def replace(self, **changes: Any) -> ArchitectureSpec:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, config: Any, qkv_bias: bool = False) -> ArchitectureSpec:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
        scaling = getattr(config, "rope_scaling", None) or rope or None
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        layers = config.num_hidden_layers
        eos = getattr(config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        attention_bias = bool(getattr(config, "attention_bias", False))
        scalar = getattr(config, "query_pre_attn_scalar", None)
        return cls(
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=_first(config, ("intermediate_size", "ffn_dim", "ffn_hidden_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=_first(config, ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"), 1e-5),
            rope_theta=float(theta),
            rope_scaling=dict(scaling) if scaling else None,
            max_positions=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias or attention_bias,
            eos_token_ids=eos_ids,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            hidden_act=_first(config, ("hidden_activation", "hidden_act", "activation", "activation_function"), "silu"),
            rotary_dim=int(head_dim * partial),
            attention_scale=(scalar if scalar else head_dim) ** -0.5,
            attn_logit_softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
            final_logit_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
            sliding_windows=_sliding_windows(config, layers),
            moe=MoESpec.from_hf_config(config, layers),
        )


def _sliding_windows(config: Any, num_layers: int) -> tuple[int, ...]:
    """Per layer, the window of a model with ``sliding_window``: every layer (Mistral, Phi-3), or the
    layers ``layer_types`` marks ``sliding_attention`` (Gemma 2 alternates; Qwen2 above max_window_layers)."""
    window = getattr(config, "sliding_window", None) or 0
    if not window or not getattr(config, "use_sliding_window", True):
        return ()
    types = getattr(config, "layer_types", None)
    return tuple(window if types is None or types[i] == "sliding_attention" else 0 for i in range(num_layers))
