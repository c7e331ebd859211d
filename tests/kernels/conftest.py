"""Kernel tests run Triton on the GPU when there is one, else on the CPU through Triton's interpreter.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it must be set before any Triton kernel
module is imported: here, at conftest import time, before the test modules are collected.
"""

from __future__ import annotations

import os

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
