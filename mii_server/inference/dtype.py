"""Step 1 of init_inference: the dtype conversion. ``int8`` is not a conversion: the model keeps its dtype
(the activations' dtype) and the injected decoder layers get weight-only int8 linears (step 3)."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InvalidRequest
from ..quantization import QuantScheme

INT8_WEIGHTS = QuantScheme(weight_format="int8", prequantized=False, origin="init_inference dtype=int8")


def weight_quantization(dtype: torch.dtype | None, inject: bool) -> QuantScheme | None:
    """The scheme the injected layers' linears use: weight-only int8 for ``dtype=int8``, else none."""
    if dtype != torch.int8:
        return None
    if not inject:
        raise InvalidRequest(
            "dtype=int8 (weight-only int8) quantizes the injected decoder layers' linears: it needs "
            "replace_with_kernel_inject=True on a family with injected kernels"
        )
    return INT8_WEIGHTS


def convert_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Cast ``model``'s floating-point parameters and buffers to ``dtype`` in place (None or int8: keep
    them; int8 is applied to the injected layers' weights)."""
    if dtype is None or dtype == torch.int8:
        return
    model.to(dtype)
