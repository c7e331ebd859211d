"""Gemma 2: embeddings scaled by sqrt(hidden), RMSNorm scaling by (1 + w), norms before and after both
attention and MLP, GeGLU, attention-logit and final-logit soft-capping, query_pre_attn_scalar, and a
sliding window on alternate layers (``layer_types``)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedModel
from ..kernels import AttentionMetadata
from .layers import RMSNorm, _copy
from .llama import LlamaDecoderLayer, LlamaForCausalLM
from .parallel import TensorParallelGroup
from .spec import ArchitectureSpec


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm multiplies by (1 + w): the checkpoint's w is loaded as 1 + w (added in float32,
    then rounded once to the model dtype; Hugging Face multiplies in float32 instead)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, ops: Any) -> None:
        super().__init__(hidden, eps, dtype, ops)
        self.weight.weight_loader = lambda p, s, shard_id=0: _copy(p, s[:].float() + 1.0)  # type: ignore[attr-defined]


class Gemma2DecoderLayer(LlamaDecoderLayer):
    norm_cls = GemmaRMSNorm

    def __init__(
        self, spec: ArchitectureSpec, index: int, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any
    ) -> None:
        super().__init__(spec, index, tp, dtype, ops)
        self.pre_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, ops)
        self.post_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, ops)

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
        h, _ = self.post_attention_layernorm(self.self_attn(h, meta, cos_sin, k_cache, v_cache))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        h, _ = self.post_feedforward_layernorm(self.mlp(h))
        return h, residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma2DecoderLayer
    norm_cls = GemmaRMSNorm

    @classmethod
    def spec_from_config(cls, config: Any) -> ArchitectureSpec:
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModel("Gemma 2 with use_bidirectional_attention is not supported (causal only)")
        return super().spec_from_config(config)

    def __init__(self, spec: ArchitectureSpec, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any) -> None:
        super().__init__(spec, tp, dtype, ops)
        # why rounded to the model dtype: Hugging Face multiplies by the scale in the weights' dtype
        self.register_buffer("embed_scale", torch.tensor(spec.hidden_size**0.5).to(dtype), persistent=False)

    def embed(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        cap = self.spec.final_logit_softcap
        logits = super().logits(h)
        return torch.tanh(logits / cap) * cap if cap else logits
