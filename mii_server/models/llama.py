"""Llama family (Llama 1/2/3) on tensor-parallel layers, and the decoder the other families build on.

Reads as the spec: T tokens of a ragged batch flow through embedding, N decoder layers (attention
over the blocked KV cache, SwiGLU MLP) and the LM head, which sees only each sequence's last token.
Another family differs by its ``ArchitectureSpec`` (biases, rotary width, per-head q/k norms, windows,
soft-caps, experts), by the classes its layers are made of, and by its checkpoint names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModel
from ..kernels import AttentionMetadata
from ..kernels.reference import split_qkv
from .checkpoint import CheckpointNames, load_checkpoint
from .layers import (
    ColumnParallelLinear,
    LayerNorm,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    even_shard,
    rope_cos_sin_cache,
)
from .parallel import TensorParallelGroup
from .spec import ArchitectureSpec

_QK_NORMS = {"rms": RMSNorm, "layer": LayerNorm}
# transformers' activation name -> the fused act-and-mul op of a gated MLP
_GATED_ACTIVATIONS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}


def kv_head_shard(num_kv_heads: int, tp: TensorParallelGroup) -> tuple[int, int]:
    """(first KV head, KV heads) kept by this rank; KV heads are replicated when fewer than ranks."""
    if num_kv_heads >= tp.size:
        start, share = tp.split(num_kv_heads)
        return start, share
    if tp.size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be shared by {tp.size} ranks")
    return tp.rank // (tp.size // num_kv_heads), 1


class LlamaAttention(nn.Module):
    """Attention of layer ``index`` over the paged KV cache (rotary, windows and soft-cap per the spec)."""

    def __init__(
        self, spec: ArchitectureSpec, index: int, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any
    ) -> None:
        super().__init__()
        self.ops = ops
        d = spec.head_dim
        q_start, self.num_heads = tp.split(spec.num_heads)
        kv_start, self.num_kv_heads = kv_head_shard(spec.num_kv_heads, tp)
        self.head_dim = d
        self.scale = spec.attention_scale
        self.rotary = spec.rotary_dim > 0
        self.options = {"sliding_window": spec.sliding_window(index), "logit_softcap": spec.attn_logit_softcap}
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
        self.o_proj = RowParallelLinear(
            spec.num_heads * d, spec.hidden_size, tp, bias=spec.o_bias, dtype=dtype, ops=ops
        )
        # Qwen3 (RMSNorm) and Phi's qk_layernorm: each head of q and k normed over D before rotary
        qk_norm = _QK_NORMS.get(spec.qk_norm)
        self.q_norm = None if qk_norm is None else qk_norm(d, spec.rms_norm_eps, dtype, ops)
        self.k_norm = None if qk_norm is None else qk_norm(d, spec.rms_norm_eps, dtype, ops)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        meta: AttentionMetadata,
        cos_sin: torch.Tensor,  # [max_positions, rotary_dim]
        k_cache: torch.Tensor,  # [B, block_size, Hk, D]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qkv_proj = self.qkv_proj
        # one op from the normed rows to attention's q (one launch at decode's few rows) where the
        # rotary is whole-head with no q/k norm between, and the weight is unquantized or fp8
        fused = self.rotary and self.q_norm is None
        rotary_args = (meta.positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
        if fused and type(qkv_proj) is ColumnParallelLinear:  # not quantized
            q = self.ops.linear_rotary_kv_append(x, qkv_proj.weight, qkv_proj.bias, *rotary_args)
        elif fused and getattr(qkv_proj, "fp8", False):
            q = qkv_proj.linear_rotary_kv_append(x, *rotary_args)
        else:
            q, k, v = split_qkv(qkv_proj(x), self.num_kv_heads, d)
            if self.q_norm is not None:
                q, k = self.q_norm(q)[0], self.k_norm(k)[0]
            if self.rotary:
                q = self.ops.rotary_kv_append(q, k, v, *rotary_args)
            else:
                self.ops.kv_append(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.ops.paged_attention(q, k_cache, v_cache, meta, self.scale, **self.options)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.num_heads * d))


class LlamaMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), SwiGLU or GeGLU per ``spec.hidden_act``.

    ``reduce=False`` leaves the down projection's partial sum unreduced (a shared expert's output
    joins the routed experts' before the layer's one all-reduce). ``fp8_activation`` (set by
    ``quantization.quantize_linears`` when ``activation_consumer`` is an fp8 linear): the activation's
    rows come out quantized per token in the same launch (``ops.silu_and_mul_fp8``); at one row, an fp8
    gate_up without bias runs with the activation in its epilogue instead
    (``ops.fp8_linear_silu_and_mul``) and the down projection quantizes that row as it reads it. An
    unquantized gate_up without bias runs with the activation in its epilogue (``ops.linear_silu_and_mul``)."""

    def __init__(
        self,
        spec: ArchitectureSpec,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        ops: Any,
        intermediate_size: int | None = None,
        reduce: bool = True,
    ) -> None:
        super().__init__()
        op = _GATED_ACTIVATIONS.get(spec.hidden_act)
        if op is None:
            raise UnsupportedModel(
                f"gated MLP activation {spec.hidden_act!r} is not supported ({', '.join(_GATED_ACTIVATIONS)} are)"
            )
        self.act_and_mul = getattr(ops, op)
        self.act_and_mul_fp8 = getattr(ops, f"{op}_fp8")
        self.linear_act_and_mul = getattr(ops, f"linear_{op}")
        self.fp8_linear_act_and_mul = getattr(ops, f"fp8_linear_{op}")
        self.fp8_activation = False
        inter = intermediate_size or spec.intermediate_size
        shard = even_shard(inter, tp)
        self.gate_up_proj = ColumnParallelLinear(spec.hidden_size, [shard, shard], tp, bias=spec.mlp_bias, dtype=dtype)
        self.down_proj = RowParallelLinear(
            inter, spec.hidden_size, tp, bias=spec.mlp_bias, dtype=dtype, reduce=reduce, ops=ops
        )

    def activation_consumer(self) -> nn.Module | None:
        """The one linear reading the activation, where this class's own forward runs."""
        return self.down_proj if type(self).forward is LlamaMLP.forward else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj
        if type(gate_up) is ColumnParallelLinear and gate_up.bias is None:  # not quantized since built
            return self.down_proj(self.linear_act_and_mul(x, gate_up.weight))
        if self.fp8_activation and gate_up.bias is None and getattr(gate_up, "fp8", False) and x.shape[0] == 1:
            gemm = gate_up.scheme.fp8_gemm
            return self.down_proj(self.fp8_linear_act_and_mul(x, gate_up.weight, gate_up.weight_scale, gemm))
        act_and_mul = self.act_and_mul_fp8 if self.fp8_activation else self.act_and_mul
        return self.down_proj(act_and_mul(gate_up(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: h = x + attention(norm(x)); out = h + mlp(norm(h)), with the residual stream
    carried beside the block's output so each norm fuses the add."""

    attention_cls: type[nn.Module] = LlamaAttention
    norm_cls: type[nn.Module] = RMSNorm

    def __init__(
        self, spec: ArchitectureSpec, index: int, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any
    ) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(spec, index, tp, dtype, ops)
        self.mlp = self.make_mlp(spec, index, tp, dtype, ops)
        self.input_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps, dtype, ops)

    def make_mlp(
        self, spec: ArchitectureSpec, index: int, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any
    ) -> nn.Module:
        return LlamaMLP(spec, tp, dtype, ops)

    def norm_consumers(self) -> list[tuple[nn.Module, nn.Module]]:
        """(norm, the one linear that reads its output) pairs of this block, where the norm may hand
        that linear its rows already quantized: only where this class's own forward, attention and
        MLP run (a family that overrides one of them is left out; its norms stay plain)."""
        if type(self).forward is not LlamaDecoderLayer.forward:
            return []
        pairs: list[tuple[nn.Module, nn.Module]] = []
        if type(self.self_attn).forward is LlamaAttention.forward:
            pairs.append((self.input_layernorm, self.self_attn.qkv_proj))
        if type(self.mlp).forward is LlamaMLP.forward:
            pairs.append((self.post_attention_layernorm, self.mlp.gate_up_proj))
        return pairs

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


class LlamaForCausalLM(nn.Module):
    """Decoder-only Llama: ``forward(input_ids, meta, kv_cache) -> float32 logits [S, vocab]``.

    Hooks for other families: ``spec_from_config`` (read and validate the config), ``layer_cls`` /
    ``make_layer``, ``norm_cls``, ``embed`` and ``logits``, ``checkpoint_names`` and ``checkpoint_parts``.
    """

    qkv_bias = False
    layer_cls: type[nn.Module] = LlamaDecoderLayer
    norm_cls: type[nn.Module] = RMSNorm
    checkpoint_names = CheckpointNames()

    @classmethod
    def spec_from_config(cls, config: Any) -> ArchitectureSpec:
        """The spec of a Hugging Face config; raises UnsupportedModel for a variant we cannot run."""
        return ArchitectureSpec.from_hf_config(config, qkv_bias=cls.qkv_bias)

    def __init__(self, spec: ArchitectureSpec, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(self.make_layer(spec, i, tp, dtype, ops) for i in range(spec.num_layers))
        self.norm = self.norm_cls(spec.hidden_size, spec.rms_norm_eps, dtype, ops)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp, dtype, ops)
        cos_sin = (
            rope_cos_sin_cache(spec.rotary_dim, spec.max_positions, spec.rope_theta, spec.rope_scaling)
            if spec.rotary_dim
            else torch.empty(0)
        )
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def make_layer(
        self, spec: ArchitectureSpec, index: int, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any
    ) -> nn.Module:
        return self.layer_cls(spec, index, tp, dtype, ops)

    def embed(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.embed_tokens(input_ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> float32 [S, vocab]
        return self.lm_head(h)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: Any) -> torch.Tensor:
        h = self.embed(input_ids, meta)  # [T, hidden]
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_cache.layer(i)
            h, residual = layer(h, residual, meta, self.cos_sin, k_cache, v_cache)
        h, _ = self.norm(h, residual)
        return self.logits(h[meta.last_token_indices])  # [S, vocab]

    def checkpoint_parts(self, name: str, source: Any, shard: Any) -> Iterable[tuple[Any, Any]]:
        """(view, shard id) pieces of checkpoint tensor ``source`` for our parameter ``name``; a family
        whose checkpoint fuses what we keep packed (Phi-3, Falcon) splits it here."""
        return ((source, shard),)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy checkpoint tensors (name, tensor or safetensors slice) into this rank's shards.

        Raises ValueError naming any parameter the checkpoint did not provide.
        """
        load_checkpoint(self, weights, self.spec.tie_word_embeddings)
