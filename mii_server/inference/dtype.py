"""Step 1 of init_inference: the dtype conversion (and, for int8, the hand-off to quantization)."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InvalidRequest


def quantize_int8_weights(model: nn.Module) -> None:
    """Weight-only int8 of ``model``'s linear layers through mii_server's quantization.

    The one hook for ``dtype="int8"``: mii_server's int8 weight-only quantization is not part of this
    build yet, so this raises instead of running the model in another precision than asked for.
    """
    raise InvalidRequest(
        "dtype=int8 (weight-only int8) is not available: mii_server's quantization is not in this build; "
        "use dtype=torch.float16, torch.bfloat16 or torch.float32"
    )


def convert_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Cast ``model``'s floating-point parameters and buffers to ``dtype`` in place (None: keep them)."""
    if dtype is None:
        return
    if dtype == torch.int8:
        quantize_int8_weights(model)
        return
    model.to(dtype)
