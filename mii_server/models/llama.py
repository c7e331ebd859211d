"""Llama family (Llama 1/2/3, and the base of Mistral and Qwen2) on tensor-parallel layers.

Reads as the spec: T tokens of a ragged batch flow through embedding, N decoder layers (attention
over the blocked KV cache, SwiGLU MLP) and the LM head, which sees only each sequence's last token.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..kernels import AttentionMetadata
from .layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    even_shard,
    rope_cos_sin_cache,
)
from .parallel import TensorParallelGroup
from .spec import ArchitectureSpec


def kv_head_shard(num_kv_heads: int, tp: TensorParallelGroup) -> tuple[int, int]:
    """(first KV head, KV heads) kept by this rank; KV heads are replicated when fewer than ranks."""
    if num_kv_heads >= tp.size:
        start, share = tp.split(num_kv_heads)
        return start, share
    if tp.size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be shared by {tp.size} ranks")
    return tp.rank // (tp.size // num_kv_heads), 1


class LlamaAttention(nn.Module):
    def __init__(self, spec: ArchitectureSpec, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any) -> None:
        super().__init__()
        self.ops = ops
        d = spec.head_dim
        q_start, self.num_heads = tp.split(spec.num_heads)
        kv_start, self.num_kv_heads = kv_head_shard(spec.num_kv_heads, tp)
        self.head_dim = d
        self.scale = d**-0.5
        self.qkv_proj = ColumnParallelLinear(
            spec.hidden_size,
            [
                (self.num_heads * d, q_start * d, spec.num_heads * d),
                (self.num_kv_heads * d, kv_start * d, spec.num_kv_heads * d),
                (self.num_kv_heads * d, kv_start * d, spec.num_kv_heads * d),
            ],
            tp,
            bias=spec.qkv_bias,
            dtype=dtype,
        )
        self.o_proj = RowParallelLinear(spec.num_heads * d, spec.hidden_size, tp, bias=False, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        meta: AttentionMetadata,
        cos_sin: torch.Tensor,  # [max_positions, D]
        k_cache: torch.Tensor,  # [B, block_size, Hk, D]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hk) D]
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = self.ops.rotary_kv_append(
            q.reshape(t, self.num_heads, d), k.reshape(t, self.num_kv_heads, d), v.reshape(t, self.num_kv_heads, d),
            meta.positions, cos_sin, k_cache, v_cache, meta.slot_mapping,
        )  # fmt: skip
        out = self.ops.paged_attention(q, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.num_heads * d))


class LlamaMLP(nn.Module):
    def __init__(self, spec: ArchitectureSpec, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any) -> None:
        super().__init__()
        self.ops = ops
        shard = even_shard(spec.intermediate_size, tp)
        self.gate_up_proj = ColumnParallelLinear(spec.hidden_size, [shard, shard], tp, bias=False, dtype=dtype)
        self.down_proj = RowParallelLinear(spec.intermediate_size, spec.hidden_size, tp, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ArchitectureSpec, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, tp, dtype, ops)
        self.mlp = LlamaMLP(spec, tp, dtype, ops)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        cos_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, meta, cos_sin, k_cache, v_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


# Hugging Face parameter name -> (our parameter name, shard of a packed matrix)
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_PACKED_NAME = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")


def packed_parameter(hf_name: str) -> tuple[str, int]:
    """(our parameter name, shard of its packed matrix) for a Hugging Face parameter name."""
    match = _PACKED_NAME.search(hf_name)
    if not match:
        return hf_name, 0
    ours, shard_id = _PACKED[match.group(1)]
    return hf_name.replace(f".{match.group(1)}.", f".{ours}."), shard_id


class LlamaForCausalLM(nn.Module):
    """Decoder-only Llama: ``forward(input_ids, meta, kv_cache) -> float32 logits [S, vocab]``."""

    qkv_bias = False

    def __init__(self, spec: ArchitectureSpec, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, tp, dtype, ops) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, ops)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp, dtype)
        cos_sin = rope_cos_sin_cache(spec.head_dim, spec.max_positions, spec.rope_theta, spec.rope_scaling)
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: Any) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [T, hidden]
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_cache.layer(i)
            h, residual = layer(h, residual, meta, self.cos_sin, k_cache, v_cache)
        h, _ = self.norm(h, residual)
        return self.lm_head(h[meta.last_token_indices])  # [S, vocab]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy checkpoint tensors (name, tensor or safetensors slice) into this rank's shards.

        Raises ValueError naming any parameter the checkpoint did not provide.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, source in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            name, shard_id = packed_parameter(name)
            targets = [name]
            if name == "embed_tokens.weight" and self.spec.tie_word_embeddings:
                targets.append("lm_head.weight")
            for target in targets:
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {hf_name} matches no parameter of {type(self).__name__}")
                param.weight_loader(param, source, shard_id)
                loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:4])}")
