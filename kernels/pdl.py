"""Programmatic dependent launch (PDL, Hopper and newer) for the kernels of a decode step.

Launched with PDL, a kernel's programs may be scheduled while the kernel before it in the stream is
still running, so its launch latency overlaps the previous kernel's tail. Every kernel launched so
calls ``gdc_wait``, which blocks until the previous kernel has finished and its writes are visible,
before it touches anything a kernel may write, and calls ``gdc_launch_dependents`` to let the next
kernel be scheduled in turn: at its start (``pdl_prologue``), or, in the few-row 16-bit GEMMs (and
the fp8 q/k/v with rotary), after their main loop (``pdl_wait`` then ``pdl_release``). Released at
their start, those GEMMs' dependents took SM slots from their later programs, and a bf16 step ran
0.02-0.36 ms slower with PDL than without. The wait is transitive: a kernel's predecessor finished
only after its own predecessor did. Kernels launched without PDL (cuBLAS, torch's) order as usual.

What no kernel of a step writes may be read before the wait: the weights, and the step's metadata
(positions, slots, sequence lengths), which the host's copy or a torch op fills before the step's
first kernel. A kernel starts only once the one before it has passed its own wait (each releases
after waiting), so everything before that one, those fills included, has finished. So the norm
loads its weight, and rotary and the decode attention their metadata, while the kernel before them
is still running (batch-1 on one H200, ``bench/gpu_benchmark.py --only latency``: bf16 4.30 -> 4.26
ms/token, fp8 3.20 -> 3.13); anything a kernel writes, and any activation, comes after the wait.
The few-row 16-bit GEMMs read their first K tile of the weight before the wait and multiply it after
their main loop (same command: bf16 4.27 -> 4.22). Multiplied before the loop, it held back the
loop's first loads (4.32 against 4.27). The same in the int8 kernel (``--quantization-mode int8``:
3.63 -> 3.81) and the fp8 GEMM (``--quantization-mode fp8``: 3.13 -> 3.66) made them slower, so they
stream every tile after the wait. Instead, the few-row fp8 GEMM and fp8 q/k/v ask L2 for their first
two K tiles before the wait (``pdl_prefetch_rows``: a hint, no registers held), so HBM fetches them
while the short kernel before runs (fp8 3.048 -> 3.036 ms, means of four and five runs; the same
hint in the 16-bit kernels and the decode attention made bf16 slower, docs/BENCHMARKS.md).

It is on wherever it is supported, except in a process that built a model with weight-only int8 or
FP6 linears (``off_for_weight_only_models``); ``MII_SERVER_PDL=1`` / ``0`` forces it on or off. By
measurement on one H200, Llama-3-8B shape, batch-1 decode (docs/BENCHMARKS.md), it pays where a
step's kernels follow each other as PDL pairs: an fp8 step (fp8 GEMMs and our norm, rotary,
attention, quantizer and activation kernels) went from 3.44 to 3.23 ms/token, and a bf16 step, once
q/k/v with rotary became our kernel and the GEMMs released after their loop, from 4.32 to 4.29. An
int8 step went the other way, from 3.61 to 3.70.

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
    pdl_wait(PDL)
    pdl_release(PDL)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel in the stream and its writes (no-op without PDL)."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel in the stream be scheduled (no-op without PDL)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_prefetch_rows(row_ptrs, LINES: tl.constexpr, PDL: tl.constexpr):
    """Before ``pdl_wait``: ask L2 for the first ``LINES`` 128-byte lines of each row that ``row_ptrs``
    [R] points at (weights: no kernel writes them). No result and no wait; a no-op without PDL, where
    nothing runs before the loads that would need it."""
    if PDL and LINES > 0:
        per_line: tl.constexpr = 1024 // row_ptrs.dtype.element_ty.primitive_bitwidth
        ptrs = row_ptrs[:, None] + (tl.arange(0, LINES) * per_line)[None, :]
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )


def prefetch_lines(row_bytes: int, wanted_bytes: int) -> int:
    """``pdl_prefetch_rows``' LINES for ``wanted_bytes`` of rows ``row_bytes`` long: a power of two
    (a ``tl.arange`` length), none past the row."""
    lines = min(row_bytes, wanted_bytes) // 128
    return 1 << (lines.bit_length() - 1) if lines else 0


@functools.lru_cache(maxsize=8)
def _supported(device: torch.device) -> bool:
    return _HAS_GDC and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


_weight_only_model_loaded = False


def off_for_weight_only_models() -> None:
    """Launch this process's kernels without PDL from now on (a model whose linears are weight-only
    int8 or FP6 GEMMs was built), unless ``MII_SERVER_PDL=1``."""
    global _weight_only_model_loaded
    _weight_only_model_loaded = True


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for launching a kernel that starts with ``pdl_prologue`` on ``device``."""
    choice = os.environ.get(PDL_ENV)
    if choice not in (None, "0", "1"):
        raise ValueError(f"{PDL_ENV} must be 0 or 1, not {choice!r}")
    on = not _weight_only_model_loaded if choice is None else choice == "1"
    return {"PDL": True, "launch_pdl": True} if on and _supported(device) else {"PDL": False}
