"""A gated MLP runs gate_up with its activation in one op (``ops.linear_silu_and_mul``) where its
gate_up is a plain product, and changes no output.

On the CPU the fused op is by definition the product followed by the activation; the Triton kernel is
checked against that composition in ``tests/kernels/test_triton_quant.py``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mii_server.models import load_model
from mii_server.models.llama import LlamaMLP

CPU = torch.device("cpu")


def _first_mlp(path: Path, **kwargs) -> tuple[LlamaMLP, int]:
    model = load_model(path, "float32", CPU, **kwargs).model
    return next(m for m in model.modules() if isinstance(m, LlamaMLP)), model.spec.hidden_size


def test_a_plain_gate_up_runs_with_its_activation_and_a_quantized_one_does_not(
    tiny_checkpoints: dict[str, Path],
) -> None:
    calls: list[torch.Tensor] = []
    mlp, hidden = _first_mlp(tiny_checkpoints["llama"])
    fused = mlp.linear_act_and_mul
    mlp.linear_act_and_mul = lambda x, w: calls.append(w) or fused(x, w)
    x = torch.randn(3, hidden)
    want = mlp.down_proj(mlp.act_and_mul(mlp.gate_up_proj(x)))
    torch.testing.assert_close(mlp(x), want, atol=0, rtol=0)
    assert len(calls) == 1 and calls[0] is mlp.gate_up_proj.weight

    quantized, _ = _first_mlp(tiny_checkpoints["llama"], quantization_mode="int8")
    quantized.linear_act_and_mul = lambda x, w: calls.append(w) or fused(x, w)
    quantized(x)
    assert len(calls) == 1  # an int8 gate_up's product is not x @ W^T: the unfused path


def test_gemma_geglu_takes_the_gelu_twin(tiny_checkpoints: dict[str, Path]) -> None:
    from mii_server.kernels import reference

    mlp, _ = _first_mlp(tiny_checkpoints["gemma2"])
    assert mlp.linear_act_and_mul is reference.linear_gelu_tanh_and_mul
