"""The gated MLP's fused gate_up and activation (``triton_fused_linear``) computes what the product
followed by the activation computes: in one launch for decode's few rows, by the unfused ops for more."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from mii_server.kernels import reference, triton_ops

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float32, torch.float16]
ROWS = [1, 7, 16, 17]  # 17: past DENSE_MAX_ROWS, the unfused ops
# (hidden, intermediate): Llama-3-8B on the GPU; on the CPU an intermediate size that leaves the last
# tile partial
HIDDEN, INTER = (4096, 14336) if ON_GPU else (128, 80)
TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-2, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1e-1, "rtol": 1.6e-2},
}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _small_integers(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Values in -3..3: every product sums exactly in float32 whatever the order, so a fused kernel
    and the ops it fuses see bit-identical products and must round them identically."""
    return torch.randint(-3, 4, shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("rows", ROWS)
def test_linear_act_and_mul_is_the_product_then_the_activation(dtype: torch.dtype, op: str, rows: int) -> None:
    fused = getattr(triton_ops, f"linear_{op}")
    exact_x = _small_integers(rows, HIDDEN, dtype=dtype)
    exact_w = _small_integers(2 * INTER, HIDDEN, dtype=dtype)
    got = fused(exact_x, exact_w)
    assert got.shape == (rows, INTER) and got.dtype == dtype
    assert torch.equal(got, getattr(triton_ops, op)(triton_ops.dense_linear(exact_x, exact_w)))

    x = torch.randn(rows, HIDDEN, device=DEVICE).to(dtype)
    weight = (torch.randn(2 * INTER, HIDDEN, device=DEVICE) / HIDDEN**0.5).to(dtype)
    want = getattr(reference, f"linear_{op}")(x.float(), weight.float())
    torch.testing.assert_close(fused(x, weight).float(), want, **TOL[dtype])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_fused_gate_up_replays_in_a_cuda_graph() -> None:
    """The decode step replays this launch in a CUDA graph: every replay gives the eager result."""
    x = torch.randn(3, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    weight = (torch.randn(2 * INTER, HIDDEN, device=DEVICE) / HIDDEN**0.5).to(torch.bfloat16)
    eager = triton_ops.linear_silu_and_mul(x, weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = triton_ops.linear_silu_and_mul(x, weight)
    for _ in range(3):
        replayed.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager)
