"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) on tensor-parallel expert weights.

A router picks each token's top-k experts (softmax over all experts' logits, then the k largest,
renormalised when the model says so); ``ops.fused_moe`` runs every expert's SwiGLU over its own
tokens (sorted by expert, one grouped GEMM per projection). Under tensor parallelism each expert is
split like an MLP: gate and up by output rows, down by input columns, so a rank's experts return a
partial sum; the shared expert (Qwen2-MoE) is split the same way, and the layer all-reduces once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModel
from .layers import _copy, narrow
from .llama import LlamaDecoderLayer, LlamaMLP
from .parallel import TensorParallelGroup
from .spec import ArchitectureSpec, MoESpec


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every rank (the router: its logits must agree everywhere)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = lambda p, s, shard_id=0: _copy(p, s[:])  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)


class ExpertWeights(nn.Module):
    """Every expert's SwiGLU weights, stacked: w13 [E, 2 I_r, H] (gate rows, then up rows) and
    w2 [E, H, I_r], where I_r is this rank's share of the expert intermediate size."""

    def __init__(self, moe: MoESpec, hidden: int, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.inter_start, self.inter = tp.split(moe.intermediate_size)
        e = moe.num_experts
        self.w13 = nn.Parameter(torch.empty(e, 2 * self.inter, hidden, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, hidden, self.inter, dtype=dtype), requires_grad=False)
        self.w13.weight_loader = self._load_w13  # type: ignore[attr-defined]
        self.w2.weight_loader = self._load_w2  # type: ignore[attr-defined]

    def _load_w13(self, param: torch.Tensor, source: Any, shard_id: tuple[int, bool]) -> None:
        expert, is_up = shard_id  # one expert's gate ([I, H], is_up False) or up projection
        rows = param[expert].narrow(0, int(is_up) * self.inter, self.inter)
        _copy(rows, narrow(source, 0, self.inter_start, self.inter))

    def _load_w2(self, param: torch.Tensor, source: Any, shard_id: int) -> None:
        _copy(param[shard_id], narrow(source, 1, self.inter_start, self.inter))  # one expert's down [H, I]


class SparseMoE(nn.Module):
    """Routed experts plus an optional sigmoid-gated shared expert; one all-reduce per layer."""

    def __init__(self, spec: ArchitectureSpec, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any) -> None:
        super().__init__()
        moe = spec.moe
        assert moe is not None
        if spec.hidden_act != "silu":
            raise UnsupportedModel(f"experts with activation {spec.hidden_act!r} are not supported (silu is)")
        self.ops = ops
        self.tp = tp
        self.top_k = moe.top_k
        self.normalize_topk = moe.normalize_topk
        self.gate = ReplicatedLinear(spec.hidden_size, moe.num_experts, dtype)  # the router
        self.experts = ExpertWeights(moe, spec.hidden_size, tp, dtype)
        if moe.shared_intermediate_size:
            self.shared_expert = LlamaMLP(spec, tp, dtype, ops, moe.shared_intermediate_size, reduce=False)
            self.shared_expert_gate = ReplicatedLinear(spec.hidden_size, 1, dtype)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        # float32 weights [T, k] and ids [T, k] of each token's top-k experts (Qwen rounds the weights
        # to the model dtype first; they stay float32 here for every family)
        weights, ids = self.ops.moe_route(self.gate(x), self.top_k, self.normalize_topk)
        out = self.ops.fused_moe(x, self.experts.w13, self.experts.w2, weights, ids)  # this rank's partial sum
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)


class MoEDecoderLayer(LlamaDecoderLayer):
    """The Llama block whose MLP is a ``SparseMoE`` on the layers the spec makes sparse."""

    def make_mlp(
        self, spec: ArchitectureSpec, index: int, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any
    ) -> nn.Module:
        if spec.moe is not None and spec.moe.is_sparse(index):
            return SparseMoE(spec, tp, dtype, ops)
        return LlamaMLP(spec, tp, dtype, ops)
