"""Phi (Phi-1/1.5/2): attention and MLP side by side on one LayerNorm's output, GELU, partial rotary,
biases everywhere (the LM head too), and optional per-head LayerNorms on q and k (qk_layernorm)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .blocks import ParallelDecoderLayer
from .checkpoint import CheckpointNames
from .layers import LayerNorm, ParallelLMHead, _copy
from .llama import LlamaForCausalLM
from .parallel import TensorParallelGroup
from .spec import ArchitectureSpec


class BiasedLMHead(ParallelLMHead):
    """The LM head plus a bias over the whole vocabulary (replicated: it is added after the gather)."""

    def __init__(
        self, vocab_size: int, hidden: int, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any = None
    ) -> None:
        super().__init__(vocab_size, hidden, tp, dtype, ops)
        self.bias = nn.Parameter(torch.zeros(vocab_size, dtype=dtype), requires_grad=False)
        self.bias.weight_loader = lambda p, s, shard_id=0: _copy(p, s[:])  # type: ignore[attr-defined]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> float32 [S, vocab]
        return super().forward(hidden) + self.bias.float()


class PhiForCausalLM(LlamaForCausalLM):
    layer_cls = ParallelDecoderLayer
    norm_cls = LayerNorm
    checkpoint_names = CheckpointNames(
        renames=(
            (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
            (r"\.(q|k)_layernorm\.", r".\1_norm."),
            (r"^final_layernorm\.", "norm."),
        )
    )

    @classmethod
    def spec_from_config(cls, config: Any) -> ArchitectureSpec:
        return (
            super()
            .spec_from_config(config)
            .replace(
                qkv_bias=True,
                o_bias=True,
                mlp_bias=True,
                qk_norm="layer" if getattr(config, "qk_layernorm", False) else "",
                parallel_block_norms=1,
            )
        )

    def __init__(self, spec: ArchitectureSpec, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any) -> None:
        super().__init__(spec, tp, dtype, ops)
        self.lm_head = BiasedLMHead(spec.vocab_size, spec.hidden_size, tp, dtype, ops)
