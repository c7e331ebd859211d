"""An int8 copy of a quantized model's LM head, read by decode steps of few rows.

At batch 1 the LM head is a decode step's largest product (Llama-3-8B's 128,256 x 4,096 reads 1.05 GB
in bf16, more than any decoder layer of an fp8 model). Its int8 copy, one float32 scale per vocabulary
row (``quantize.quantize_int8``), reads half that. Both through ``logits_linear``, µs per head on an
H100 (CUDA-graph replay; ``PYTHONPATH=. python3 bench/kernels_bench.py --no-attention --logits
--gemm-rows 1 16 64 128 256``):

| rows | 16-bit head | int8 copy |
| --- | --- | --- |
| 1 | 333.7 | 172.7 |
| 16 | 353.6 | 187.4 |
| 64 | 417.5 | 281.8 |
| 128 | 451.1 | 380.6 (346.2 with the int8 GEMM's later tiles, ``INT8_WIDE_TILES``) |
| 256 | 560.9 (cuBLAS) | 766.8 |

Between 128 and 256 rows Triton's weight-only GEMM falls behind cuBLAS, so the model-dtype head stays,
and steps of more than ``INT8_HEAD_MAX_ROWS`` rows use it: the copy costs a quarter of the head's
16-bit bytes (0.5 GB on Llama-3-8B) and takes nothing from wide steps. End to end, fp8 weights at
batch 1 on the same H100: 3.278 ms a token against 3.434-3.441 without the copy (-4.6%,
``bench/gpu_benchmark.py --only latency --no-hf --quantization-mode fp8``).

Accuracy (``bench/lm_head_fp8.py --accuracy``: two tiny random Llamas, each position's greedy token
against an exact float32 head): the int8 copy with bf16 logits moves the chosen token's
log-probability by 0.0041 / 0.0021 nats and changes 1.2% / 2.2% of greedy tokens, where the bf16 head
moves it by 0.0028 / 0.0016 and changes 0.6% / 2.3%; an fp8 head (W8A8) moves it by 0.0192 / 0.0115,
which is why the copy is int8.

Installed on CUDA devices only, for every quantized model (``quantize_model``): a quantized model
already trades the last bits of its products for bytes. On the CPU the reference ops would dequantize
the whole head every step, so the head stays as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..models.layers import ParallelLMHead
from .quantize import quantize_int8

INT8_HEAD_MAX_ROWS = 128  # steps of at most this many rows read the int8 copy (table above)
_QUANTIZE_ROWS = 8192  # vocabulary rows quantized at a time while loading (bounds the float32 copy)


class Int8CopyLMHead(ParallelLMHead):
    """``ParallelLMHead`` (taking over the original's weight and shard) with an int8 copy of its rows,
    made as the weight loads, that steps of at most ``INT8_HEAD_MAX_ROWS`` rows multiply instead."""

    def __init__(self, original: ParallelLMHead, ops: Any) -> None:
        nn.Module.__init__(self)
        self.tp = original.tp
        self.vocab_size = original.vocab_size
        self.vocab_start, self.shard_rows = original.vocab_start, original.shard_rows
        self.weight = original.weight
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        self._logits = ops.logits_linear
        rows, hidden = self.weight.shape
        device = self.weight.device
        self.register_buffer("int8_weight", torch.zeros(rows, hidden, dtype=torch.int8, device=device))
        self.register_buffer("int8_scale", torch.ones(rows, 1, dtype=torch.float32, device=device))

    def _load(self, param: torch.Tensor, source: Any, shard_id: int = 0) -> None:
        super()._load(param, source, shard_id)
        with torch.no_grad():
            for start in range(0, param.shape[0], _QUANTIZE_ROWS):
                rows = param[start : start + _QUANTIZE_ROWS].float()
                codes, scale = quantize_int8(rows, 0, rows.shape[1])
                self.int8_weight[start : start + rows.shape[0]] = codes
                self.int8_scale[start : start + rows.shape[0]] = scale

    def shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] <= INT8_HEAD_MAX_ROWS:
            return self._logits(hidden, self.int8_weight, self.int8_scale)
        return self._logits(hidden, self.weight)

    def extra_repr(self) -> str:
        return f"int8 copy for steps of <= {INT8_HEAD_MAX_ROWS} rows, weight={tuple(self.weight.shape)}"


def add_int8_head_copies(model: nn.Module, ops: Any) -> int:
    """Swap each plain ``ParallelLMHead`` of ``model`` (built, weights not loaded) for an
    ``Int8CopyLMHead`` multiplying with ``ops``; returns how many. Heads of other classes (Phi's,
    with a bias) are left as they are."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is ParallelLMHead:
                setattr(parent, name, Int8CopyLMHead(child, ops))
                swapped += 1
    return swapped
