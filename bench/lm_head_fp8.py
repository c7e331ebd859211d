"""What a quantized LM head would gain and cost (issue 14: the head stays in the model dtype unless
measured otherwise): an fp8 head (measured, not built) and the int8 copy (built: ``quantization.lm_head``).

- ``--speed`` (CUDA): Llama-3-8B's head, 128,256 x 4,096, as ``F.linear`` in bf16 against
  ``fp8_linear`` on a per-row fp8 copy of the weight (every GEMM choice), each followed by the cast to
  fp32 logits the model makes; CUDA-graph replay over 2 weight copies, microseconds per product.
- ``--accuracy`` (any device, CPU is enough): a tiny random Llama in transformers, fp32. Its head is
  replaced by the fp8 product the server would run (weight per row, activations per token, both
  dequantized), by the int8 copy a quantized bf16 model's head keeps on a GPU (``quantization.lm_head``:
  weight per row, logits rounded to bf16) and by the bf16 head itself, and each position's greedy
  token is scored under each head against the exact one: mean |delta log-prob| in nats per token,
  and how often the greedy token changes. Random weights give near-uniform logits, so the figures
  are rough.

    PYTHONPATH=$PWD python3 bench/lm_head_fp8.py --speed --accuracy
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from mii_server.kernels import reference
from mii_server.kernels.reference_quant import quantize_fp8_per_token
from mii_server.quantization.quantize import quantize_fp8, quantize_int8

HEAD = (128256, 4096)
# (name, build_tiny_checkpoint overrides): the GPU quantization test's tiny Llama, and the demo's shape
TINY_MODELS = {
    "llama_hidden256": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                        "num_key_value_heads": 2},
    "llama_demo_shape": {},
}  # fmt: skip


def graph_us(fn, copies: int) -> float:
    import triton

    return triton.testing.do_bench_cudagraph(fn) / copies * 1e3


def speed() -> None:
    from mii_server.kernels import triton_fp8

    n, k = HEAD
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(2)]
    fp8 = [quantize_fp8(w.float(), 0, k) for w in weights]
    for rows in (1, 16, 64, 256):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        bf16_us = graph_us(lambda x=x: [F.linear(x, w).float() for w in weights], len(weights))
        for gemm in triton_fp8.FP8_GEMMS:
            fp8_us = graph_us(lambda x=x, gemm=gemm: [triton_fp8.fp8_linear(x, q, s, None, gemm).float() for q, s in fp8],
                              len(fp8))  # fmt: skip
            print(json.dumps({"bench": "lm_head_speed", "rows": rows, "gemm": gemm, "bf16_us": round(bf16_us, 1),
                              "fp8_us": round(fp8_us, 1)}))  # fmt: skip


def fake_fp8_head(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h [N, H] @ weight^T as the fp8 head computes it: both operands rounded to fp8, in fp32."""
    wq, w_scale = quantize_fp8(weight.float(), 0, weight.shape[1])
    xq, x_scale = quantize_fp8_per_token(h)
    return (xq.float() * x_scale[:, None]) @ (wq.float() * w_scale).T


def int8_copy_head(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The logits of a bf16 model's head through its int8 copy (``quantization.lm_head``), as the
    reference twin of the server's kernel computes them: h in bf16, the product rounded to bf16."""
    codes, scale = quantize_int8(weight.float(), 0, weight.shape[1])
    return reference.logits_linear(h.bfloat16(), codes, scale)


def bf16_head(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The logits of a bf16 model's head as the server computes them: the product in bf16."""
    return reference.logits_linear(h.bfloat16(), weight.bfloat16())


HEADS = {"fp8": fake_fp8_head, "int8_copy": int8_copy_head, "bf16": bf16_head}


def accuracy() -> None:
    from transformers import AutoModelForCausalLM

    from mii_server.demo_model import build_tiny_checkpoint

    for name, overrides in TINY_MODELS.items():
        with tempfile.TemporaryDirectory() as tmp:
            path = build_tiny_checkpoint(Path(tmp) / name, "llama", seed=3, **overrides)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        torch.manual_seed(0)
        ids = torch.randint(3, model.config.vocab_size, (8, 64))
        with torch.no_grad():
            h = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size)  # after the final norm
            weight = model.lm_head.weight
            exact = torch.log_softmax(h @ weight.T, -1)
            greedy = exact.argmax(-1, keepdim=True)
            for head, product in HEADS.items():
                quantized = torch.log_softmax(product(h, weight), -1)
                gap = (quantized.gather(-1, greedy) - exact.gather(-1, greedy)).abs().mean().item()
                changed = (quantized.argmax(-1, keepdim=True) != greedy).float().mean().item()
                print(json.dumps({"bench": "lm_head_accuracy", "model": name, "hidden": model.config.hidden_size,
                                  "head": head, "mean_abs_dlogprob_nats": round(gap, 4),
                                  "greedy_changed": round(changed, 4)}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", action="store_true", help="time the head on the GPU")
    parser.add_argument("--accuracy", action="store_true", help="each head's error on tiny models")
    args = parser.parse_args()
    if args.speed:
        speed()
    if args.accuracy:
        accuracy()


if __name__ == "__main__":
    main()
