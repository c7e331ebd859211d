"""Kernel dispatch (re-exported by the package): one functional interface, a pure-PyTorch reference
and (on CUDA) Triton twins.

``get_ops(device)`` returns the namespace of ops for a device: Triton kernels on CUDA when Triton is
importable, the reference ops elsewhere. ``MII_SERVER_KERNELS=reference`` forces the reference on
every device (for debugging a suspected kernel bug); ``MII_SERVER_KERNELS=triton`` makes a missing
Triton an error instead of a silent fallback.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from . import reference

__all__ = ["KERNELS_ENV", "get_ops"]

KERNELS_ENV = "MII_SERVER_KERNELS"


def get_ops(device: torch.device | str) -> ModuleType:
    """The op namespace (``rms_norm``, ``silu_and_mul``, ``gelu_tanh_and_mul``, ``rotary_kv_append``,
    ``kv_append``, ``paged_attention``, ``moe_route``, ``fused_moe``) to use for tensors on ``device``."""
    choice = os.environ.get(KERNELS_ENV, "auto").lower()
    if choice not in ("auto", "reference", "triton"):
        raise ValueError(f"{KERNELS_ENV} must be auto, reference or triton, not {choice!r}")
    if choice == "reference":
        return reference
    if torch.device(device).type != "cuda" and choice == "auto":
        return reference
    try:
        from . import triton_ops
    except ImportError:
        if choice == "triton":
            raise
        return reference
    return triton_ops
