"""Quantized linear layers: MII's ``quantization_mode`` and pre-quantized fp8 checkpoints.

The loader calls three things, in order: ``resolve_scheme`` (what the checkpoint and the mode ask
for, refused early when it cannot run), ``quantize_model`` (swap the model's linears for quantized
twins before any weight loads) and ``checkpoint_tensors`` (the checkpoint's tensor names as the
quantized layers expect them). See ``scheme`` for the formats, ``linear`` for the layers and their
tensor-parallel sharding, ``quantize`` for load-time quantization, ``lm_head`` for the LM head's int8
copy (CUDA only).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..kernels import get_ops, reference
from .linear import QuantizedColumnParallelLinear, QuantizedRowParallelLinear, quantize_linears
from .lm_head import INT8_HEAD_MAX_ROWS, add_int8_head_copies
from .scheme import QUANTIZATION_MODES, QuantScheme, fp8_supported, resolve_scheme

__all__ = [
    "QUANTIZATION_MODES", "QuantScheme", "QuantizedColumnParallelLinear", "QuantizedRowParallelLinear",
    "checkpoint_tensors", "fp8_supported", "quantize_model", "resolve_scheme",
]  # fmt: skip

log = logging.getLogger(__name__)

# static activation scales of fp8 checkpoints: unused, fp8 layers quantize activations per token
_UNUSED_SUFFIXES = (".input_scale", ".activation_scale")


def quantize_model(model: nn.Module, scheme: QuantScheme, device: torch.device) -> None:
    """Swap ``model``'s linears (built, not loaded) for quantized twins using ``device``'s kernels
    (the reference ops for fp8 on a device without fp8 tensor cores); on CUDA, give its LM head an int8
    copy for decode's few rows (``lm_head``). Weight-only int8 and FP6 in Triton turn programmatic
    dependent launch off for the process (``kernels.pdl``: measured slower)."""
    ops = reference if scheme.emulated else get_ops(device)
    count = quantize_linears(model, scheme, ops)
    # the head keeps its dtype and gains an int8 copy for few-row steps
    head_copies = add_int8_head_copies(model, get_ops(device)) if device.type == "cuda" else 0
    if scheme.weight_format in ("int8", "fp6") and ops is not reference:
        from ..kernels.pdl import off_for_weight_only_models  # why here: Triton is imported only with its ops

        off_for_weight_only_models()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the full-precision placeholders' memory goes back to the device
    log.info(
        "quantized %d linear layers to %s (%s); %d LM head(s) with an int8 copy for steps of <= %d rows",
        count, scheme.weight_format, scheme.origin, head_copies, INT8_HEAD_MAX_ROWS,
    )  # fmt: skip


def checkpoint_tensors(weights: Iterable[tuple[str, Any]], scheme: QuantScheme) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (name, tensor) pairs renamed for the quantized layers: Hugging Face's
    ``weight_scale_inv`` (a multiplier, despite its name) becomes ``weight_scale``, and static
    activation scales are dropped."""
    for name, source in weights:
        if scheme.prequantized:
            if name.endswith(_UNUSED_SUFFIXES):
                continue
            if name.endswith(".weight_scale_inv"):
                name = name.removesuffix("_inv")
        yield name, source
