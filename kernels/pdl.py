"""Programmatic dependent launch (PDL, Hopper and newer) for the kernels of a decode step.

Launched with PDL, a kernel's programs may be scheduled while the kernel before it in the stream is
still running, so its launch latency overlaps the previous kernel's tail. Every kernel launched so
must start with ``pdl_prologue``: ``gdc_wait`` blocks until the previous kernel has finished and
its writes are visible (nothing is read or written before that), then ``gdc_launch_dependents``
lets the next kernel be scheduled in turn. The wait is transitive: a kernel's predecessor finished
only after its own predecessor did. Kernels launched without PDL (cuBLAS, torch's) order as usual.

Where it is on, by measurement (one H200, Llama-3-8B shape, batch-1 decode, docs/BENCHMARKS.md):
it pays only where a step's kernels follow each other as PDL pairs, which is the fp8 model's step
(fp8 GEMMs and our norm, rotary, attention, quantizer and activation kernels): 3.44 -> 3.23
ms/token. A bf16 step, whose qkv and gate_up products are cuBLAS's, ran 0.02-0.27 ms slower with
it, and no faster with those two in our kernel too; so it is off there. That loss comes from the
few-row 16-bit GEMMs letting their dependents launch at their start: moved after their main loop,
the release made a bf16 step with PDL as fast as one without (4.38 against 4.36 ms/token), no
faster, and left fp8 unchanged, so it stays at the start. ``enable_for_fp8_models``
(called when a model's linears become fp8 on fp8 tensor cores) turns it on for the process;
``MII_SERVER_PDL=1`` / ``0`` forces it on or off.

``pdl_launch(device)`` gives a kernel's launch arguments: ``PDL`` and Triton's ``launch_pdl``,
only on CUDA devices of compute capability 9.0 and newer with a Triton that has grid dependency
control. Correctness does not depend on the setting: each kernel waits for its predecessor either way.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # a Triton without grid dependency control: PDL stays off

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        pass

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        pass

    _HAS_GDC = False

PDL_ENV = "MII_SERVER_PDL"


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Wait for the previous kernel in the stream, then let the next one launch (no-op without PDL)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=8)
def _supported(device: torch.device) -> bool:
    return _HAS_GDC and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


_fp8_model_loaded = False


def enable_for_fp8_models() -> None:
    """Launch this process's decode kernels with PDL from now on (a model whose linears are fp8
    GEMMs on fp8 tensor cores was built), unless ``MII_SERVER_PDL=0``."""
    global _fp8_model_loaded
    _fp8_model_loaded = True


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for launching a kernel that starts with ``pdl_prologue`` on ``device``."""
    choice = os.environ.get(PDL_ENV)
    if choice not in (None, "0", "1"):
        raise ValueError(f"{PDL_ENV} must be 0 or 1, not {choice!r}")
    on = _fp8_model_loaded if choice is None else choice == "1"
    return {"PDL": True, "launch_pdl": True} if on and _supported(device) else {"PDL": False}
