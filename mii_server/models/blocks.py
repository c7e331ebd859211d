"""Blocks of the LayerNorm families (Phi, Falcon, OPT): a plain MLP, the pre-LayerNorm sequential
block, and the parallel block where attention and MLP read the same input."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModel
from ..kernels import AttentionMetadata
from .layers import ColumnParallelLinear, LayerNorm, RowParallelLinear, even_shard
from .llama import LlamaAttention, LlamaDecoderLayer
from .parallel import TensorParallelGroup
from .spec import ArchitectureSpec


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate="tanh")


# transformers' activation name -> the function (gelu_new is the tanh approximation written out)
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": nn.functional.relu,
    "gelu": nn.functional.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
}


class PlainMLP(nn.Module):
    """fc2(act(fc1(x))): fc1 split by output rows, fc2 by input columns (one all-reduce)."""

    def __init__(self, spec: ArchitectureSpec, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        act = _ACTIVATIONS.get(spec.hidden_act)
        if act is None:
            raise UnsupportedModel(
                f"MLP activation {spec.hidden_act!r} is not supported ({', '.join(_ACTIVATIONS)} are)"
            )
        self.act = act
        inter = spec.intermediate_size
        self.fc1 = ColumnParallelLinear(spec.hidden_size, [even_shard(inter, tp)], tp, bias=spec.mlp_bias, dtype=dtype)
        self.fc2 = RowParallelLinear(inter, spec.hidden_size, tp, bias=spec.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.fc2(self.act(self.fc1(x)))


class LayerNormDecoderLayer(LlamaDecoderLayer):
    """The sequential pre-norm block with LayerNorms and a plain MLP (OPT, Falcon without parallel_attn)."""

    norm_cls = LayerNorm

    def make_mlp(
        self, spec: ArchitectureSpec, index: int, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any
    ) -> nn.Module:
        return PlainMLP(spec, tp, dtype)


class ParallelDecoderLayer(nn.Module):
    """out = x + attention(norm(x)) + mlp(norm'(x)): Phi's and Falcon's block. norm' is norm itself
    with one norm (``spec.parallel_block_norms`` 1), or its own LayerNorm with two (Falcon-40B)."""

    def __init__(
        self, spec: ArchitectureSpec, index: int, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, index, tp, dtype, ops)
        self.mlp = PlainMLP(spec, tp, dtype)
        self.input_layernorm = LayerNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        two = spec.parallel_block_norms == 2
        self.mlp_layernorm = LayerNorm(spec.hidden_size, spec.rms_norm_eps, dtype) if two else None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        cos_sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)  # residual: this block's input stream
        h_mlp = h if self.mlp_layernorm is None else self.mlp_layernorm(residual)[0]
        return self.self_attn(h, meta, cos_sin, k_cache, v_cache) + self.mlp(h_mlp), residual
