"""Tensor-parallel building blocks shared by every model family.

Each parameter carries a ``weight_loader(param, source, shard_id)`` that copies this rank's part of
a checkpoint tensor into it. ``source`` is a torch tensor or a safetensors slice: the loader only
reads the rows or columns it keeps, so no rank materialises the whole checkpoint tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..kernels import reference
from .parallel import TensorParallelGroup


def narrow(source: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """``source[..., start:start+length, ...]`` along ``dim`` for a tensor or a safetensors slice."""
    index = [slice(None)] * (dim + 1)
    index[dim] = slice(start, start + length)
    return source[tuple(index)]


def shape_of(source: Any) -> list[int]:
    return list(source.shape) if isinstance(source, torch.Tensor) else list(source.get_shape())


def _copy(param: torch.Tensor, value: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"checkpoint shape {tuple(value.shape)} does not match parameter {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's output rows split over the ranks; several logical outputs
    (e.g. q, k, v or gate, up) may be packed into one matrix, each split on its own."""

    def __init__(
        self,
        in_features: int,
        out_shards: Sequence[tuple[int, int, int]],
        tp: TensorParallelGroup,
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        """``out_shards``: per packed output, (rows kept by this rank, first row kept, unit) where
        ``unit`` is the checkpoint row count per replica (rows are taken as a block from
        ``first row kept``)."""
        super().__init__()
        self.tp = tp
        self.out_shards = list(out_shards)
        rows = sum(r for r, _, _ in out_shards)
        self.weight = nn.Parameter(torch.empty(rows, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(rows, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self._load  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def _load(self, param: torch.Tensor, source: Any, shard_id: int = 0) -> None:
        offset = sum(r for r, _, _ in self.out_shards[:shard_id])
        rows, first, _ = self.out_shards[shard_id]
        _copy(param.narrow(0, offset, rows), narrow(source, 0, first, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def even_shard(total: int, tp: TensorParallelGroup) -> tuple[int, int, int]:
    start, share = tp.split(total)
    return share, start, total


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's input columns split over the ranks and the partial sums all-reduced.

    ``reduce=False`` returns this rank's partial sum (the caller reduces it with others, once).
    ``ops``: the product runs in ``ops.dense_linear`` (a single-launch kernel for decode's few rows on
    the GPU, whose narrow output makes cuBLAS split K); without, in ``torch.nn.functional.linear``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TensorParallelGroup,
        bias: bool,
        dtype: torch.dtype,
        reduce: bool = True,
        ops: Any = None,
    ) -> None:
        super().__init__()
        assert reduce or not bias, "a bias must be added once, after the reduction"
        self.tp = tp
        self.reduce = reduce
        self._product = nn.functional.linear if ops is None else ops.dense_linear
        self.in_start, in_share = tp.split(in_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_share, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load_weight  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = lambda p, s, shard_id=0: _copy(p, s[:])  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def _load_weight(self, param: torch.Tensor, source: Any, shard_id: int = 0) -> None:
        _copy(param, narrow(source, 1, self.in_start, param.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x, self.weight)
        if self.reduce:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over the ranks (padded to divide evenly)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        padded = math.ceil(vocab_size / tp.size) * tp.size
        self.vocab_start, self.shard_rows = tp.split(padded)
        self.weight = nn.Parameter(torch.zeros(self.shard_rows, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, source: Any, shard_id: int = 0) -> None:
        rows = max(0, min(self.shard_rows, self.vocab_size - self.vocab_start))
        _copy(param[:rows], narrow(source, 0, self.vocab_start, rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [T] -> [T, hidden]
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_rows)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary, split like the embedding; logits gathered in full.

    ``ops``: the product runs in ``ops.logits_linear`` (for decode's few rows on the GPU, one launch
    that writes the float32 logits, where cuBLAS's product is followed by a cast); without, in
    ``reference.logits_linear``."""

    def __init__(
        self, vocab_size: int, hidden: int, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any = None
    ) -> None:
        super().__init__(vocab_size, hidden, tp, dtype)
        self._logits = reference.logits_linear if ops is None else ops.logits_linear

    def shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> float32 [S, shard_rows]
        return self._logits(hidden, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> float32 [S, vocab]
        return self.tp.all_gather_last_dim(self.shard_logits(hidden))[:, : self.vocab_size]


class RMSNorm(nn.Module):
    """RMSNorm whose forward takes and returns the residual stream (fused add where the kernel can).

    ``fp8_output`` (set by ``quantization.quantize_linears`` when the one linear reading this norm is
    fp8): the normed rows come out quantized per token (``Fp8Rows``, from ``ops.rms_norm_fp8``), which
    saves that linear its own quantizing launch and a pass over the rows."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, ops: Any) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.fp8_output = False
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = lambda p, s, shard_id=0: _copy(p, s[:])  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[Any, torch.Tensor]:
        if self.fp8_output:
            return self.ops.rms_norm_fp8(x, self.weight, self.eps, residual)
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class LayerNorm(nn.Module):
    """LayerNorm (with bias) behind RMSNorm's interface: takes and returns the residual stream
    (``ops`` is accepted for RMSNorm's signature; torch's layer_norm is already one kernel)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, ops: Any = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden, dtype=dtype), requires_grad=False)
        for param in (self.weight, self.bias):
            param.weight_loader = lambda p, s, shard_id=0: _copy(p, s[:])  # type: ignore[attr-defined]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = x if residual is None else x + residual
        return nn.functional.layer_norm(stream, self.weight.shape, self.weight, self.bias, self.eps), stream


def rope_cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """float32 [max_positions, head_dim]: cos of the head_dim/2 frequencies, then their sin.

    Supports the default rope, ``linear`` scaling and Llama-3's frequency scaling; computed in
    float32 exactly as Hugging Face does, so positions agree bit for bit.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])  # type: ignore[index]
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
    elif kind != "default":
        from ..errors import UnsupportedModel

        raise UnsupportedModel(f"rope scaling {kind!r} is not supported (default, linear and llama3 are)")
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between smoothed.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    middle = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(middle, smoothed, scaled)
