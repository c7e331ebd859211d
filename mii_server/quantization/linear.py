"""Quantized twins of the column- and row-parallel linears, and the swap that installs them.

``quantize_linears(model, scheme, ops)`` replaces every ``ColumnParallelLinear`` and
``RowParallelLinear`` of a freshly built model (before its weights load) with a quantized layer of
the same shard geometry, so any model family built on those layers is quantized without knowing it;
the embedding and LM head are other classes and keep the model dtype.

A quantized layer holds ``weight`` (int8 [rows, cols], packed FP6 uint8 [rows, 3 cols / 4], or fp8
[rows, cols]) and float32 ``weight_scale`` [rows, G] (G = 1 but for block-scaled fp8 checkpoints: one
scale per ``block_k`` input columns). Tensor parallelism shards both together: a column-parallel layer
keeps whole rows (its scales are its rows' scales), a row-parallel layer keeps a range of input
columns and every row's scale, computed over the whole row when quantizing at load, so each rank's
codes are the codes of the unsharded weight. Quantizing at load reads whole rows: a row-parallel rank
reads the whole checkpoint tensor, then keeps its columns.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModel
from ..models.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, narrow
from .quantize import QUANTIZERS
from .scheme import QuantScheme


def _storage(fmt: str, rows: int, cols: int) -> tuple[tuple[int, int], torch.dtype]:
    if fmt == "fp6":
        if cols % 4:
            raise UnsupportedModel(f"wf6af16 needs a multiple of 4 input columns per rank, not {cols}")
        return (rows, 3 * cols // 4), torch.uint8
    return (rows, cols), torch.int8 if fmt == "int8" else torch.float8_e4m3fn


def _read(source: Any) -> torch.Tensor:
    """A whole checkpoint tensor (safetensors slice or tensor), 0-d ones included."""
    return source if isinstance(source, torch.Tensor) else source[...]


class _QuantizedLinear(nn.Module):
    """Storage, scale handling and product shared by both parallel layouts; a layout provides the
    loaders ``_load_weight`` and ``_load_scale`` (``weight_loader(param, source, shard_id)``)."""

    def __init__(
        self, rows: int, cols: int, scheme: QuantScheme, ops: Any, bias: nn.Parameter | None, device: torch.device
    ) -> None:
        super().__init__()
        self.scheme = scheme
        self.cols = cols
        shape, dtype = _storage(scheme.weight_format, rows, cols)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self._load_weight  # type: ignore[attr-defined]
        groups = 1 if scheme.block_k is None else -(-cols // scheme.block_k)
        scale = torch.ones(rows, groups, dtype=torch.float32, device=device)
        if scheme.prequantized:  # a checkpoint tensor of its own
            self.weight_scale = nn.Parameter(scale, requires_grad=False)
            self.weight_scale.weight_loader = self._load_scale  # type: ignore[attr-defined]
        else:  # derived from the weight as it loads
            self.register_buffer("weight_scale", scale)
        self.bias = bias
        linear = getattr(ops, f"{scheme.weight_format}_linear")
        self._linear = functools.partial(linear, gemm=scheme.fp8_gemm) if scheme.weight_format == "fp8" else linear

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [T, cols] -> [T, rows]
        return self._linear(x, self.weight, self.weight_scale, bias)

    def _checkpoint_fp8(self, value: torch.Tensor) -> torch.Tensor:
        if value.dtype != torch.float8_e4m3fn:
            raise UnsupportedModel(
                f"a decoder linear weight of this fp8 checkpoint is {value.dtype}, not float8_e4m3fn: "
                "checkpoints that leave decoder linear layers unquantized are not supported"
            )
        return value

    def _scale_rows(self, source: Any, rows: int) -> torch.Tensor:
        """The checkpoint's scales of a ``rows``-row weight as float32 [rows, G_checkpoint]."""
        scale = _read(source).float()
        if scale.numel() == 1:  # per tensor
            return scale.reshape(1, 1).expand(rows, 1)
        if self.scheme.block is None:  # per channel
            return scale.reshape(rows, 1)
        return scale.repeat_interleave(self.scheme.block[0], dim=0)[:rows]  # [ceil(rows / bn), G] blocks

    def _store(self, param: torch.Tensor, first_row: int, stored: torch.Tensor, scale: torch.Tensor) -> None:
        with torch.no_grad():
            param[first_row : first_row + stored.shape[0]] = stored.to(param.device)
            self.weight_scale[first_row : first_row + stored.shape[0]] = scale.to(self.weight_scale.device)

    def extra_repr(self) -> str:
        return f"{self.scheme.weight_format}, weight={tuple(self.weight.shape)}, scale={tuple(self.weight_scale.shape)}"


class QuantizedColumnParallelLinear(_QuantizedLinear):
    """``ColumnParallelLinear`` over a quantized weight: this rank's output rows, whole input rows."""

    def __init__(self, original: ColumnParallelLinear, scheme: QuantScheme, ops: Any) -> None:
        rows, cols = original.weight.shape
        super().__init__(rows, cols, scheme, ops, original.bias, original.weight.device)
        self.out_shards = original.out_shards
        self.fp8 = scheme.weight_format == "fp8"
        fused = functools.partial(ops.fp8_linear_rotary_kv_append, gemm=scheme.fp8_gemm) if self.fp8 else None
        self._fp8_rotary_kv_append = fused

    def linear_rotary_kv_append(
        self,
        x: Any,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """A packed q/k/v of fp8 weights (``fp8``): the product, whole-head rotary and the KV append in
        one op (``ops.fp8_linear_rotary_kv_append``, one launch at decode's few rows); returns q."""
        assert self._fp8_rotary_kv_append is not None, "only fp8 weights have the fused q/k/v op"
        return self._fp8_rotary_kv_append(
            x, self.weight, self.weight_scale, self.bias, positions, cos_sin_cache, k_cache, v_cache, slot_mapping
        )

    def _rows_of(self, shard_id: int) -> tuple[int, int, int]:
        """(first row here, rows kept, first checkpoint row) of packed output ``shard_id``."""
        rows, first, _ = self.out_shards[shard_id]
        return sum(r for r, _, _ in self.out_shards[:shard_id]), rows, first

    def _load_weight(self, param: torch.Tensor, source: Any, shard_id: int = 0) -> None:
        offset, rows, first = self._rows_of(shard_id)
        value = narrow(source, 0, first, rows)
        if self.scheme.prequantized:
            with torch.no_grad():
                param[offset : offset + rows] = self._checkpoint_fp8(value).to(param.device)
            return
        full = value.to(param.device, torch.float32)  # whole rows: their scales are this rank's
        self._store(param, offset, *QUANTIZERS[self.scheme.weight_format](full, 0, self.cols))

    def _load_scale(self, param: torch.Tensor, source: Any, shard_id: int = 0) -> None:
        offset, rows, first = self._rows_of(shard_id)
        unit = self.out_shards[shard_id][2]
        with torch.no_grad():
            param[offset : offset + rows] = self._scale_rows(source, unit)[first : first + rows].to(param.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, self.bias)


class QuantizedRowParallelLinear(_QuantizedLinear):
    """``RowParallelLinear`` over a quantized weight: every output row, this rank's input columns."""

    def __init__(self, original: RowParallelLinear, scheme: QuantScheme, ops: Any) -> None:
        rows, cols = original.weight.shape
        super().__init__(rows, cols, scheme, ops, original.bias, original.weight.device)
        self.tp = original.tp
        self.in_start = original.in_start
        self.reduce = original.reduce  # False: the caller reduces this partial sum with others, once

    def _load_weight(self, param: torch.Tensor, source: Any, shard_id: int = 0) -> None:
        if self.scheme.prequantized:
            value = self._checkpoint_fp8(narrow(source, 1, self.in_start, self.cols))
            with torch.no_grad():
                param.copy_(value.to(param.device))
            return
        full = _read(source).to(param.device, torch.float32)  # every column: the scale spans the row
        self._store(param, 0, *QUANTIZERS[self.scheme.weight_format](full, self.in_start, self.cols))

    def _load_scale(self, param: torch.Tensor, source: Any, shard_id: int = 0) -> None:
        scale = self._scale_rows(source, param.shape[0])  # [rows, G of the whole row]
        if scale.shape[1] > 1:
            block_k = self.scheme.block_k
            assert block_k is not None
            if self.in_start % block_k or self.cols % block_k:
                raise UnsupportedModel(
                    f"{self.cols} input columns per rank do not split the checkpoint's {block_k}-column "
                    "weight-scale blocks evenly; use fewer tensor-parallel ranks"
                )
            scale = scale[:, self.in_start // block_k : (self.in_start + self.cols) // block_k]
        with torch.no_grad():
            param.copy_(scale.to(param.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x, None)
        if self.reduce:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def quantize_linears(model: nn.Module, scheme: QuantScheme, ops: Any) -> int:
    """Replace every column- and row-parallel linear of ``model`` (weights not loaded yet) by its
    quantized twin; returns how many were replaced. The full-precision placeholders are freed.

    fp8 on fp8 tensor cores: each RMSNorm whose output only an fp8 linear reads (a block's
    ``norm_consumers``) then quantizes that output itself (``RMSNorm.fp8_output``), and so does each
    gated MLP's activation for its down projection (``activation_consumer``, ``fp8_activation``)."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, ColumnParallelLinear):
                twin: nn.Module = QuantizedColumnParallelLinear(child, scheme, ops)
            elif isinstance(child, RowParallelLinear):
                twin = QuantizedRowParallelLinear(child, scheme, ops)
            else:
                continue
            # why: the weight's loader is a bound method of the layer (a cycle); dropping the
            # parameter frees its memory now rather than at the next garbage collection
            child.weight = None
            setattr(parent, name, twin)
            replaced += 1
    if scheme.weight_format == "fp8" and not scheme.emulated:
        for block in model.modules():
            if not hasattr(block, "norm_consumers"):  # only decoder blocks say which norm feeds what
                continue
            for norm, linear in block.norm_consumers():
                if isinstance(norm, RMSNorm) and isinstance(linear, _QuantizedLinear):
                    norm.fp8_output = True
        for mlp in model.modules():
            consumer = getattr(mlp, "activation_consumer", None)
            if consumer is not None and isinstance(consumer(), _QuantizedLinear):
                mlp.fp8_activation = True
    return replaced
