"""Quantized linear kernels (``triton_quant``, ``triton_fp8``) against their reference twins, the
few-row 16-bit GEMMs (``dense_linear``; from ``triton_fused_linear``, gate_up with its activation and
q/k/v with rotary and the KV append), and the FP6 e3m2 format itself.

On CUDA: Llama-like shapes in bf16/fp16 (the few-row GEMMs in fp32 too). On the CPU: Triton's
interpreter at tiny shapes, with row counts that reach each tile configuration (1, 16 < M <= 64,
M > 64).
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

pytest.importorskip("triton")

from mii_server.kernels import reference_quant
from mii_server.kernels.fp6_format import fp6_encode, fp6_values, pack_fp6, unpack_fp6
from mii_server.kernels.triton_quant import INT8_MIDDLE_TILES
from mii_server.quantization.quantize import quantize_fp6, quantize_fp8, quantize_int8

ON_GPU = torch.cuda.is_available()
INTERPRETED = not ON_GPU and os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not (ON_GPU or INTERPRETED), reason="no GPU and TRITON_INTERPRET is not set")
FP8_DEVICE = ON_GPU and torch.cuda.get_device_capability() >= (8, 9)

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float32, torch.float16]
ROWS = [1, 7, 48, 300] if ON_GPU else [1, 20, 70]
SHAPES = [(4096, 4096), (1024, 14336)] if ON_GPU else [(48, 64), (40, 96)]  # (N, K)
# one rounding of the output more or less than the reference, plus float32 summation order
TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 2e-2, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1e-1, "rtol": 1.6e-2},
}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _weight(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k, device=DEVICE) * 0.05


# ---- the FP6 format --------------------------------------------------------------------------------


def test_fp6_values_are_e3m2() -> None:
    mags = fp6_values()[:32].tolist()
    assert mags[:8] == [0, 0.0625, 0.125, 0.1875, 0.25, 0.3125, 0.375, 0.4375]
    assert mags[-4:] == [16, 20, 24, 28]
    assert fp6_values()[32:].tolist() == [-m for m in mags]


def test_fp6_encode_is_nearest_value() -> None:
    x = torch.randn(4000) * 10
    x = torch.cat((x, torch.tensor([0.0, 28.0, -28.0, 40.0, 0.03])))
    codes = fp6_encode(x)
    values = fp6_values()
    nearest = (x.clamp(-28, 28)[:, None] - values[None, :]).abs().min(dim=1).values
    torch.testing.assert_close((values[codes.long()] - x.clamp(-28, 28)).abs(), nearest, atol=0, rtol=0)


def test_fp6_pack_round_trip_and_size() -> None:
    codes = torch.randint(0, 64, (5, 32), dtype=torch.uint8)
    packed = pack_fp6(codes)
    assert packed.shape == (5, 24) and packed.dtype == torch.uint8
    assert torch.equal(unpack_fp6(packed), codes)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_fp6(codes[:, :30])


def test_load_time_quantizers_bound_their_error() -> None:
    w = _weight(16, 64).cpu()
    int8, s8 = quantize_int8(w, 0, 64)
    assert (int8.float() * s8 - w).abs().max() <= s8.max() / 2 + 1e-7
    fp6, s6 = quantize_fp6(w, 0, 64)
    err6 = (reference_quant.dequantize_weight(fp6, s6, torch.float32) - w).abs()
    assert (err6 <= 0.125 * w.abs() + s6 * 0.0625 / 2 + 1e-7).all()  # 2 mantissa bits; subnormal step
    fp8, s8 = quantize_fp8(w, 16, 32)  # columns 16..48, scaled by the whole rows
    assert fp8.shape == (16, 32)
    assert torch.equal(s8, w.abs().amax(dim=1, keepdim=True) / 448)
    assert ((fp8.float() * s8 - w[:, 16:48]).abs() <= 0.0625 * w[:, 16:48].abs() + s8 * 2**-9).all()


# ---- weight-only GEMMs -----------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", ["int8", "fp6"])
def test_weight_only_linear(fmt: str, shape: tuple[int, int], rows: int, dtype: torch.dtype) -> None:
    from mii_server.kernels import triton_quant

    n, k = shape
    weight, scale = (quantize_int8 if fmt == "int8" else quantize_fp6)(_weight(n, k), 0, k)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    got = getattr(triton_quant, f"{fmt}_linear")(x, weight, scale, bias)
    want = getattr(reference_quant, f"{fmt}_linear")(x, weight, scale, bias)
    torch.testing.assert_close(got, want, **TOL[dtype])
    no_bias = getattr(triton_quant, f"{fmt}_linear")(x, weight, scale)
    torch.testing.assert_close(no_bias, getattr(reference_quant, f"{fmt}_linear")(x, weight, scale), **TOL[dtype])


@needs_triton
@pytest.mark.parametrize("fmt", ["int8", "fp6"])
def test_weight_only_large_batches_dequantize(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from mii_server.kernels import triton_quant

    monkeypatch.setattr(triton_quant, "DEQUANT_MIN_ROWS", 4)
    n, k = SHAPES[0]
    weight, scale = (quantize_int8 if fmt == "int8" else quantize_fp6)(_weight(n, k), 0, k)
    x = torch.randn(9, k, device=DEVICE).to(DTYPES[0])
    got = getattr(triton_quant, f"{fmt}_linear")(x, weight, scale)
    torch.testing.assert_close(got, getattr(reference_quant, f"{fmt}_linear")(x, weight, scale), **TOL[DTYPES[0]])


@needs_triton
@pytest.mark.parametrize("rows", [20, 40])
@pytest.mark.parametrize("tiles", [t for *_, narrow, wide in INT8_MIDDLE_TILES for t in (narrow, wide)])
def test_int8_linear_middle_row_tiles(rows: int, tiles: tuple[int, int, int, int, int]) -> None:
    """Each tile shape the int8 GEMM takes at 17-64 rows gives the reference's product."""
    from mii_server.kernels import triton_quant

    n, k = SHAPES[1]
    weight, scale = quantize_int8(_weight(n, k), 0, k)
    x = torch.randn(rows, k, device=DEVICE).to(DTYPES[0])
    got = triton_quant.weight_only_linear(x, weight, scale, None, False, tiles)
    torch.testing.assert_close(got, reference_quant.int8_linear(x, weight, scale), **TOL[DTYPES[0]])


def test_int8_middle_rows_take_narrow_tiles_while_their_grid_is_small() -> None:
    """At 17-32 rows the 16 x 32 tiles up to 4 programs per SM, at 33-64 the 32 x 64 ones up to one;
    wider products take the wide tiles. (Llama-3-8B's products on 132 SMs, as measured.)"""
    from mii_server.kernels.triton_quant import _tiles

    (*_, narrow_32, wide_32), (*_, narrow_64, wide_64) = INT8_MIDDLE_TILES
    for n, at_32, at_64 in [(4096, narrow_32, narrow_64), (6144, narrow_32, wide_64), (28672, wide_32, wide_64)]:
        assert _tiles(32, n, 4096, 1, False, 132) == at_32
        assert _tiles(64, n, 4096, 1, False, 132) == at_64
    assert _tiles(32, 4096, 4096, 2, False, 132) == (64, 64, 128, 4, 4), "16-bit weights keep their tiles"


# ---- fp8 -------------------------------------------------------------------------------------------


def _fp8_case(n: int, k: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    weight = (torch.randn(n, k, device=DEVICE) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return weight, torch.rand(n, groups, device=DEVICE) * 0.01 + 1e-3


@needs_triton
@pytest.mark.skipif(ON_GPU and not FP8_DEVICE, reason="no fp8 tensor cores")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("groups", [1, 4])
def test_fp8_triton_gemm(groups: int, rows: int, dtype: torch.dtype) -> None:
    """The Triton GEMM on reference-quantized activations (per-channel and group-wise weight scales)."""
    from mii_server.kernels import triton_fp8

    n, k = SHAPES[0]
    weight, scale = _fp8_case(n, k, groups)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    q, x_scale = reference_quant.quantize_fp8_per_token(x)
    got = triton_fp8.fp8_gemm_triton(q, x_scale, weight, scale, bias, dtype)
    torch.testing.assert_close(got, reference_quant.fp8_linear(x, weight, scale, bias), **TOL[dtype])


# Llama-3-8B's products (N, K), and one wider, with the fp8 GEMM's tiles for them at 17-32 rows on 132 SMs
FP8_MIDDLE_ROW_TILES = {
    (4096, 4096): (32, 32, 512, 4, 3),  # o_proj: 128 programs
    (4096, 14336): (32, 32, 512, 4, 3),  # down
    (6144, 4096): (32, 32, 512, 4, 3),  # q/k/v: 192 programs
    (12288, 4096): (32, 32, 256, 4, 3),  # a wider product: 384 programs
    (28672, 4096): (32, 64, 128, 4, 4),  # gate_up: 896 programs
}


@needs_triton
@pytest.mark.skipif(ON_GPU and not FP8_DEVICE, reason="no fp8 tensor cores")
@pytest.mark.parametrize("rows", [17, 32])
@pytest.mark.parametrize("tiles", sorted(set(FP8_MIDDLE_ROW_TILES.values())))
def test_fp8_triton_gemm_middle_row_tiles(rows: int, tiles: tuple[int, int, int, int, int]) -> None:
    """Each tile shape the fp8 GEMM takes at 17-32 rows gives the reference's product."""
    from mii_server.kernels import triton_fp8

    n, k = SHAPES[1]
    weight, scale = _fp8_case(n, k, 1)
    x = torch.randn(rows, k, device=DEVICE).to(DTYPES[0])
    q, x_scale = reference_quant.quantize_fp8_per_token(x)
    got = triton_fp8.fp8_gemm_triton(q, x_scale, weight, scale, None, DTYPES[0], tiles)
    torch.testing.assert_close(got, reference_quant.fp8_linear(x, weight, scale), **TOL[DTYPES[0]])


@needs_triton
@pytest.mark.skipif(ON_GPU and not FP8_DEVICE, reason="no fp8 tensor cores")
def test_fp8_middle_rows_take_the_triton_gemm_with_tiles_by_grid_size(monkeypatch) -> None:
    """``gemm="auto"`` sends up to 32 rows to the Triton GEMM and more to ``torch._scaled_mm``; at
    17-32 rows, one 32-row slice: 32 x 32 tiles with a K step of 512 under 2 programs per SM, 256
    under 4, and wider products 32 x 64 tiles. (Llama-3-8B's products and one wider, on 132 SMs.)"""
    from mii_server.kernels import triton_fp8

    for (n, k), want in FP8_MIDDLE_ROW_TILES.items():
        assert triton_fp8._tiles(32, n, k, 132) == want
        assert triton_fp8._tiles(17, n, k, 132) == want
    assert triton_fp8._tiles(16, 4096, 4096, 132) == (16, 32, 512, 4, 3), "few rows keep their tiles"

    taken = []
    for name in ("fp8_gemm_triton", "fp8_gemm_scaled_mm"):
        gemm = getattr(triton_fp8, name)
        monkeypatch.setattr(triton_fp8, name, lambda *a, _name=name, _gemm=gemm: taken.append(_name) or _gemm(*a))
    n, k = SHAPES[0]
    weight, scale = _fp8_case(n, k, 1)
    for rows in (32, 33):
        x = torch.randn(rows, k, device=DEVICE).to(torch.bfloat16)
        triton_fp8.fp8_linear(reference_quant.Fp8Rows(*reference_quant.quantize_fp8_per_token(x), x.dtype),
                              weight, scale)  # fmt: skip
    assert taken == ["fp8_gemm_triton", "fp8_gemm_scaled_mm"]


# ---- one row on the CUDA cores (triton_one_row) ----------------------------------------------------


def _one_row_case(weights: str, dtype: torch.dtype):
    """(the op under test, its reference) at one row of ``weights``, N no multiple of any BLOCK_N and
    (but for fp8 groups, a scale per 128 columns) K none of any K step."""
    from mii_server.kernels import triton_fp8, triton_quant

    n, k = (45, 512) if weights == "fp8 groups" else (45, 1100)
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    if weights == "16-bit":
        weight = _weight(n, k).to(dtype)
        return partial(triton_quant.dense_linear, x, weight), partial(torch.nn.functional.linear, x, weight)
    if weights == "int8":
        weight, scale = quantize_int8(_weight(n, k), 0, k)
        return (partial(triton_quant.int8_linear, x, weight, scale, bias),
                partial(reference_quant.int8_linear, x, weight, scale, bias))  # fmt: skip
    weight, scale = _fp8_case(n, k, 4 if weights == "fp8 groups" else 1)
    if weights == "fp8, 16-bit x":  # quantized per token inside the one-row kernel
        if not ON_GPU:  # fp8 codes times a power of two: exact in the interpreter's rounding (see below)
            codes = _weight(1, k).mul(400).clamp(-448, 448).to(torch.float8_e4m3fn).float()
            codes[0, 0] = 448.0
            x = (codes * 2**-4).to(dtype)
        return (partial(triton_fp8.fp8_linear, x, weight, scale, bias),
                partial(reference_quant.fp8_linear, x, weight, scale, bias))  # fmt: skip
    q, x_scale = reference_quant.quantize_fp8_per_token(x)
    return (partial(triton_fp8.fp8_gemm_triton, q, x_scale, weight, scale, bias, dtype),
            partial(reference_quant.fp8_linear, x, weight, scale, bias))  # fmt: skip


NO_FP8 = pytest.mark.skipif(ON_GPU and not FP8_DEVICE, reason="no fp8 tensor cores")
# quantizing in a kernel: Triton's interpreter rounds fp32 -> fp8 wrongly where rounding carries into
# the exponent (7.9 -> 4.0), so on the CPU x holds values the quantizer meets exactly


@needs_triton
@pytest.mark.parametrize(
    "weights",
    [
        pytest.param("fp8", marks=NO_FP8),
        pytest.param("fp8 groups", marks=NO_FP8),
        pytest.param("fp8, 16-bit x", marks=NO_FP8),
        "int8",
        "16-bit",
    ],
)
@pytest.mark.parametrize("sum_each_step", [False, True])
def test_one_row_kernel_at_ragged_edges(weights: str, sum_each_step: bool, monkeypatch) -> None:
    """One row of each weight kind runs the CUDA-core kernel, in both of its accumulations (summed each
    step, or once after the loop), where its tiles leave the last rows and the last K step partial."""
    from mii_server.kernels import triton_fp8, triton_one_row, triton_quant

    monkeypatch.setattr(triton_one_row, "_num_sms", lambda device: 1 if sum_each_step else 1 << 20)
    launches = []
    kernel = triton_one_row.one_row_linear
    for module in (triton_fp8, triton_quant):
        monkeypatch.setattr(module, "one_row_linear", lambda *a, **kw: launches.append(a) or kernel(*a, **kw))
    run, reference = _one_row_case(weights, DTYPES[0])
    torch.testing.assert_close(run(), reference(), **TOL[DTYPES[0]])
    assert len(launches) == 1


@pytest.mark.skipif(ON_GPU and not FP8_DEVICE, reason="no fp8 tensor cores")
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fast_accum", [False, True])
def test_fp8_scaled_mm_gemm(rows: int, fast_accum: bool) -> None:
    """``torch._scaled_mm`` with row-wise scales (runs on the CPU too), output in bfloat16. Fast
    accumulation (a benchmarks' option) sums in the tensor cores' narrower adder: on an H100 3-350
    elements left the tolerance of one rounding, by up to 0.5, so it is held to a relative error of
    the whole product instead (there 2.3-2.4e-3 at every row count, against 0.6-0.8e-3 without)."""
    from mii_server.kernels import triton_fp8

    n, k = SHAPES[0]
    weight, scale = _fp8_case(n, k, 1)
    x = torch.randn(rows, k, device=DEVICE).to(torch.bfloat16)
    q, x_scale = reference_quant.quantize_fp8_per_token(x)
    got = triton_fp8.fp8_gemm_scaled_mm(q, x_scale, weight, scale, None, torch.bfloat16, fast_accum)
    want = reference_quant.fp8_linear(x, weight, scale)
    if not fast_accum:
        torch.testing.assert_close(got, want, **TOL[torch.bfloat16])
    else:
        assert torch.linalg.norm((got - want).float()) <= 4e-3 * torch.linalg.norm(want.float())


@pytest.mark.skipif(not FP8_DEVICE, reason="Triton's interpreter rounds fp32 -> fp8 wrongly where rounding "
                    "carries into the exponent (7.9 -> 4.0); the kernel is checked on an fp8 GPU")  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemm", ["triton", "scaled_mm"])
def test_fp8_linear_on_gpu(gemm: str, dtype: torch.dtype) -> None:
    from mii_server.kernels import triton_fp8

    x = torch.randn(37, 4096, device=DEVICE).to(dtype) * 3
    q, x_scale = triton_fp8.quantize_fp8_per_token(x)
    want_q, want_scale = reference_quant.quantize_fp8_per_token(x)
    torch.testing.assert_close(x_scale, want_scale, atol=0, rtol=0)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    weight, scale = _fp8_case(4096, 4096, 1)
    got = triton_fp8.fp8_linear(x, weight, scale, None, gemm=gemm)
    # scaled_mm writes bf16 (see fp8_gemm_scaled_mm): an fp16 caller gets bf16's rounding
    tol = TOL[torch.bfloat16 if gemm == "scaled_mm" else dtype]
    torch.testing.assert_close(got, reference_quant.fp8_linear(x, weight, scale), **tol)


@needs_triton
@pytest.mark.skipif(ON_GPU and not FP8_DEVICE, reason="no fp8 tensor cores")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("tokens", [1, 9])  # one row: batch-1 decode, launched with more warps
def test_rms_norm_fp8_is_the_norm_then_the_per_token_quantizer(
    dtype: torch.dtype, with_residual: bool, tokens: int
) -> None:
    """One launch: the RMSNorm kernel's rows, quantized as ``quantize_fp8_per_token`` quantizes them."""
    from mii_server.kernels import triton_pointwise

    hidden = 4096 if ON_GPU else 96
    x = (torch.randn(tokens, hidden, device=DEVICE) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    residual = torch.randn(tokens, hidden, device=DEVICE).to(dtype) if with_residual else None
    rows, stream = triton_pointwise.rms_norm_fp8(x, weight, 1e-6, residual)
    normed, want_stream = triton_pointwise.rms_norm(x, weight, 1e-6, residual)
    want_q, want_scale = reference_quant.quantize_fp8_per_token(normed)
    assert rows.dtype == dtype and rows.values.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(stream, want_stream, atol=0, rtol=0)
    torch.testing.assert_close(rows.scale, want_scale, atol=0, rtol=0)
    if FP8_DEVICE:  # the interpreter rounds fp32 -> fp8 wrongly where rounding carries (see below)
        assert torch.equal(rows.values.view(torch.uint8), want_q.view(torch.uint8))


@needs_triton
@pytest.mark.skipif(ON_GPU and not FP8_DEVICE, reason="no fp8 tensor cores")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("count,width", [(1, "mlp"), (17, "mlp"), (3, "limit"), (3, "wide")])
def test_act_and_mul_fp8_is_the_activation_then_the_per_token_quantizer(
    dtype: torch.dtype, op: str, count: int, width: str
) -> None:
    """One launch, a program per row: the gated activation's rows quantized as
    ``quantize_fp8_per_token`` quantizes them, the row held whole (a Llama MLP's width, or just
    under ACT_WHOLE_ROW_MAX columns) or, ``wide`` (past it), in two passes of column chunks, the
    last one partial; the reference twin is the same composition."""
    from mii_server.kernels import reference, triton_pointwise

    widest = triton_pointwise.ACT_WHOLE_ROW_MAX
    inter = {"mlp": 14336 if ON_GPU else 5000, "limit": widest - 1000, "wide": widest + 1000}[width]
    x = (torch.randn(count, 2 * inter, device=DEVICE) * 3).to(dtype)
    rows = getattr(triton_pointwise, f"{op}_fp8")(x)
    want_q, want_scale = reference_quant.quantize_fp8_per_token(getattr(triton_pointwise, op)(x))
    assert rows.dtype == dtype and rows.values.dtype == torch.float8_e4m3fn and rows.shape == (count, inter)
    torch.testing.assert_close(rows.scale, want_scale, atol=0, rtol=0)
    if FP8_DEVICE:  # the interpreter's fp32 -> fp8 rounding differs where rounding carries
        assert torch.equal(rows.values.view(torch.uint8), want_q.view(torch.uint8))
    ref, y = getattr(reference, f"{op}_fp8")(x.cpu().float()), getattr(reference, op)(x.cpu().float())
    # e4m3 keeps 3 mantissa bits: within half a unit (1/16 of the value) or a subnormal step of the scale
    assert ((ref.values.float() * ref.scale[:, None] - y).abs() <= y.abs() / 16 + ref.scale[:, None]).all()


@needs_triton
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32] if ON_GPU else DTYPES)  # fp32: a smaller K step
@pytest.mark.parametrize("rows", [1, 7, 16, 17])
def test_dense_linear_is_the_plain_product(dtype: torch.dtype, rows: int, monkeypatch) -> None:
    """Few rows and a narrow output run the single-launch Triton GEMM, the rest cuBLAS; both are x W^T."""
    from mii_server.kernels import triton_quant

    launches = []
    kernel = triton_quant.weight_only_linear
    monkeypatch.setattr(triton_quant, "weight_only_linear", lambda *a: launches.append(a) or kernel(*a))
    # one 32-row weight slice per SM at most; on the CPU, K spans K steps, the last one partial
    n, k = (4096, 14336) if ON_GPU else (64, 600)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    torch.testing.assert_close(
        triton_quant.dense_linear(x, weight), torch.nn.functional.linear(x.float(), weight.float()).to(dtype),
        **TOL[dtype],
    )  # fmt: skip
    assert len(launches) == (rows <= triton_quant.DENSE_MAX_ROWS)


@needs_triton
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32] if ON_GPU else DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 16, 17])
def test_logits_linear_rounds_the_product_to_the_model_dtype(dtype: torch.dtype, rows: int, monkeypatch) -> None:
    """The LM head: float32 logits holding the product rounded to x's dtype, as a product in x's dtype
    cast to float32 (transformers' logits) holds it; few rows in one Triton launch (one row: the one-row
    kernel), the rest cuBLAS."""
    from mii_server.kernels import triton_quant

    launches = []
    kernel = triton_quant.weight_only_linear
    monkeypatch.setattr(triton_quant, "weight_only_linear", lambda *a, **kw: launches.append(a) or kernel(*a, **kw))
    # a vocabulary over many 128-column slices, the last one partial; K over several K steps
    n, k = (32003, 4096) if ON_GPU else (300, 600)
    # non-negative integers: every sum is exact in float32 whatever the order, and large enough that
    # rounding to a 16-bit dtype changes it, so the comparison below is exact
    x = torch.randint(0, 4, (rows, k), device=DEVICE).to(dtype)
    weight = torch.randint(0, 8, (n, k), device=DEVICE).to(dtype)
    exact = torch.nn.functional.linear(x.double(), weight.double())
    got = triton_quant.logits_linear(x, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert len(launches) == (rows <= triton_quant.DENSE_MAX_ROWS)
    if launches:
        assert torch.equal(got, exact.to(dtype).float())
        if dtype != torch.float32:
            assert not torch.equal(got, exact.float()), "the sums must be ones the rounding changes"
    else:  # cuBLAS's product, which may sum split-K partials in the 16-bit dtype, cast to float32
        assert torch.equal(got, torch.nn.functional.linear(x, weight).float())


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64, 128])
@pytest.mark.parametrize("vocab", [32003] if ON_GPU else [300, 600])
def test_logits_linear_of_an_int8_head(dtype: torch.dtype, rows: int, vocab: int) -> None:
    """An int8 head with its per-row scales (``quantization.lm_head``): the reference's logits exactly,
    the scaled product rounded to x's dtype and stored as float32, at one row and at every row count
    the head's copy is read at. On the CPU (4 "SMs") 128 rows take the int8 GEMM's short-grid tiles
    over 300 columns and its wide ones over 600 (``INT8_WIDE_TILES``)."""
    from mii_server.kernels import reference, triton_quant

    n, k = vocab, 4096 if ON_GPU else 600
    # small integers and power-of-two scales: every sum and scaling is exact whatever the order
    x = torch.randint(0, 4, (rows, k), device=DEVICE).to(dtype)
    weight = torch.randint(-8, 9, (n, k), device=DEVICE, dtype=torch.int8)
    scale = 2.0 ** torch.randint(-6, 0, (n, 1), device=DEVICE).float()
    got = triton_quant.logits_linear(x, weight, scale)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert torch.equal(got, reference.logits_linear(x, weight, scale))


# (hidden, intermediate) of the fused gate_up: Llama-3-8B on the GPU; on the CPU a hidden size over
# several K steps and an intermediate size, each leaving its last tile partial
GATED_SHAPE = (4096, 14336) if ON_GPU else (300, 84)


def _small_integers(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Values in -3..3: every product sums exactly in float32 whatever the order, so a fused kernel
    and the ops it fuses see bit-identical products and must round them identically."""
    return torch.randint(-3, 4, shape, device=DEVICE).to(dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32] if ON_GPU else DTYPES)
@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("rows", [1, 7, 16, 17])  # 17: past DENSE_MAX_ROWS, the unfused ops
def test_linear_act_and_mul_is_the_product_then_the_activation(dtype: torch.dtype, op: str, rows: int) -> None:
    """One launch for few rows: gate and up rounded as the product stores them, then the activation."""
    from mii_server.kernels import reference, triton_ops

    hidden, inter = GATED_SHAPE
    fused = getattr(triton_ops, f"linear_{op}")
    exact_x = _small_integers(rows, hidden, dtype=dtype)
    exact_w = _small_integers(2 * inter, hidden, dtype=dtype)
    got = fused(exact_x, exact_w)
    assert got.shape == (rows, inter) and got.dtype == dtype
    assert torch.equal(got, getattr(triton_ops, op)(triton_ops.dense_linear(exact_x, exact_w)))

    x = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    weight = (torch.randn(2 * inter, hidden, device=DEVICE) / hidden**0.5).to(dtype)
    want = getattr(reference, f"linear_{op}")(x.float(), weight.float())
    torch.testing.assert_close(fused(x, weight).float(), want, **TOL[dtype])


@needs_triton
@pytest.mark.skipif(ON_GPU and not FP8_DEVICE, reason="no fp8 tensor cores")
def test_one_row_fused_ops_take_the_one_row_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """At one row, gate_up with its activation and q/k/v with rotary (16-bit and fp8) each run their
    one-row kernel, once (their results are checked against the unfused ops in the tests around)."""
    from mii_server.kernels import triton_fused_linear

    launched = []

    class Counted:
        def __init__(self, name: str) -> None:
            self.name, self.kernel = name, getattr(triton_fused_linear, name)

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in ("_one_row_act_and_mul_kernel", "_one_row_qkv_rotary_kernel"):
        monkeypatch.setattr(triton_fused_linear, name, Counted(name))
    dtype = DTYPES[0]
    hidden, inter = GATED_SHAPE
    triton_fused_linear.linear_silu_and_mul(torch.randn(1, hidden, device=DEVICE).to(dtype),
                                            _weight(2 * inter, hidden).to(dtype))  # fmt: skip
    hidden, hq, hk, d = QKV_SHAPE
    positions, cos_sin, slots, (k_cache, v_cache) = _rotary_case(1, dtype)
    x = torch.randn(1, hidden, device=DEVICE).to(dtype)
    rest = (positions, cos_sin, k_cache, v_cache, slots)
    triton_fused_linear.linear_rotary_kv_append(x, _weight((hq + 2 * hk) * d, hidden).to(dtype), None, *rest)
    weight, scale = _fp8_case((hq + 2 * hk) * d, hidden, 1)
    triton_fused_linear.fp8_linear_rotary_kv_append(x, weight, scale, None, *rest)
    hidden, inter = GATED_SHAPE
    rows = reference_quant.Fp8Rows(*reference_quant.quantize_fp8_per_token(torch.randn(1, hidden, device=DEVICE)),
                                   dtype)  # fmt: skip
    triton_fused_linear.fp8_linear_silu_and_mul(rows, *_fp8_case(2 * inter, hidden, 1))
    assert launched == [
        "_one_row_act_and_mul_kernel", *["_one_row_qkv_rotary_kernel"] * 2, "_one_row_act_and_mul_kernel"
    ]


@needs_triton
@pytest.mark.skipif(ON_GPU and not FP8_DEVICE, reason="no fp8 tensor cores")
@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_gate_up_with_its_activation(op: str, rows: int) -> None:
    """An fp8 gate_up and its activation (one launch at one row; more rows: the fp8 GEMM, then the
    activation) against the reference composition, rows already quantized as the norm hands them."""
    from mii_server.kernels import reference, triton_ops

    hidden, inter = GATED_SHAPE
    dtype = DTYPES[0]
    q, x_scale = reference_quant.quantize_fp8_per_token(torch.randn(rows, hidden, device=DEVICE))
    x = reference_quant.Fp8Rows(q, x_scale, dtype)
    weight, scale = _fp8_case(2 * inter, hidden, 1)
    got = getattr(triton_ops, f"fp8_linear_{op}")(x, weight, scale)
    assert got.shape == (rows, inter) and got.dtype == dtype
    torch.testing.assert_close(got, getattr(reference, f"fp8_linear_{op}")(x, weight, scale), **TOL[dtype])


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_fused_gate_up_replays_in_a_cuda_graph() -> None:
    """The decode step replays this launch in a CUDA graph: every replay gives the eager result."""
    from mii_server.kernels import triton_ops

    hidden, inter = GATED_SHAPE
    x = torch.randn(3, hidden, device=DEVICE, dtype=torch.bfloat16)
    weight = (torch.randn(2 * inter, hidden, device=DEVICE) / hidden**0.5).to(torch.bfloat16)
    eager = triton_ops.linear_silu_and_mul(x, weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = triton_ops.linear_silu_and_mul(x, weight)
    for _ in range(3):
        replayed.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager)


# one rounding of a rotated value apart (float32: of the exact products, which reach ~10^4, where
# a*cos - b*sin may cancel)
ROTARY_TOL = {
    torch.float32: {"atol": 1e-2, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
}
# (hidden, query heads, KV heads, head size) of the fused q/k/v: Llama-3-8B on the GPU; on the CPU a
# hidden size over more than one K step, the last partial
QKV_SHAPE = (4096, 32, 8, 128) if ON_GPU else (300, 4, 2, 32)


def _cos_sin(max_positions: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, device=DEVICE).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _rotary_case(rows: int, dtype: torch.dtype) -> tuple:
    """A step's rotary and append operands for QKV_SHAPE: positions, the cos/sin table, cache slots
    (past one row, the middle row's -1 marks a padding token: nothing is written) and the K and V caches."""
    hk, d = QKV_SHAPE[2:]
    num_blocks, block_size = 8, 16
    positions = torch.randint(0, 4096, (rows,), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:rows]
    if rows > 1:  # one row is written: the one-row kernel's append is checked
        slots[rows // 2] = -1
    caches = [torch.randn(num_blocks, block_size, hk, d, device=DEVICE).to(dtype) for _ in range(2)]
    return positions, _cos_sin(4096, d), slots, caches


def _run_rotary(op, operands: tuple, case: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, K cache, V cache) of ``op(*operands, positions, cos_sin, k_cache, v_cache, slots)``, run on
    fresh copies of the case's caches."""
    positions, cos_sin, slots, caches = case
    k_cache, v_cache = (c.clone() for c in caches)
    return op(*operands, positions, cos_sin, k_cache, v_cache, slots), k_cache, v_cache


@needs_triton
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32] if ON_GPU else DTYPES)  # fp32: a smaller K step
@pytest.mark.parametrize("rows", [1, 7, 16, 17])  # 17: past DENSE_MAX_ROWS, the unfused ops
@pytest.mark.parametrize("with_bias", [False, True])  # Qwen2's q/k/v carry a bias
def test_linear_rotary_kv_append_is_the_product_then_rotary_and_the_append(
    dtype: torch.dtype, rows: int, with_bias: bool
) -> None:
    """One launch for few rows: q/k/v rounded as the product stores them, rotated and rounded as
    ``rotary_kv_append`` does, k and v written to their slots (none for a padding token's -1)."""
    from mii_server.kernels import reference, triton_ops

    hidden, hq, hk, d = QKV_SHAPE
    case = _rotary_case(rows, dtype)

    def run(op, x, weight, bias):
        return _run_rotary(op, (x, weight, bias), case)

    def unfused(x, weight, bias, *rest):
        qkv = torch.nn.functional.linear(x, weight, bias).view(rows, -1, d)
        return triton_ops.rotary_kv_append(*qkv.split([hq, hk, hk], dim=1), *rest)

    n = (hq + 2 * hk) * d
    exact = (_small_integers(rows, hidden, dtype=dtype), _small_integers(n, hidden, dtype=dtype))
    exact_bias = _small_integers(n, dtype=dtype) if with_bias else None
    got = run(triton_ops.linear_rotary_kv_append, *exact, exact_bias)
    assert got[0].shape == (rows, hq, d) and got[0].dtype == dtype
    want = run(unfused, *exact, exact_bias)
    assert torch.equal(got[2], want[2])  # v: the exact product, rounded once, in its slots (only there)
    for got_part, want_part in zip(got[:2], want[:2]):  # q and k: rotary may contract into FMAs differently
        torch.testing.assert_close(got_part, want_part, **ROTARY_TOL[dtype])

    x = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    weight = (torch.randn(n, hidden, device=DEVICE) / hidden**0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    got = run(triton_ops.linear_rotary_kv_append, x, weight, bias)
    want = run(reference.linear_rotary_kv_append, x.float(), weight.float(), None if bias is None else bias.float())
    for got_part, want_part in zip(got, want):
        torch.testing.assert_close(got_part.float(), want_part.float(), **TOL[dtype])


@needs_triton
@pytest.mark.skipif(ON_GPU and not FP8_DEVICE, reason="no fp8 tensor cores")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 16, 17])  # 17: past FEW_ROWS, fp8_linear then rotary
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_linear_rotary_kv_append_is_the_fp8_product_then_rotary_and_the_append(
    dtype: torch.dtype, rows: int, with_bias: bool
) -> None:
    """fp8 weights: one launch for few rows, scaled and rounded as the fp8 GEMM stores q/k/v, then
    rotated and appended as ``rotary_kv_append`` does."""
    from mii_server.kernels import reference, triton_ops
    from mii_server.kernels.reference_quant import Fp8Rows

    hidden, hq, hk, d = QKV_SHAPE
    n = (hq + 2 * hk) * d
    case = _rotary_case(rows, dtype)
    # powers of two: the scaled exact sums stay exact, so the fused and unfused epilogues see equal values
    x_scale = 2.0 ** torch.randint(-3, 2, (rows,), device=DEVICE).float()
    w_scale = 2.0 ** torch.randint(-3, 2, (n, 1), device=DEVICE).float()

    def run(op, x, weight, bias, scale=w_scale):
        return _run_rotary(op, (x, weight, scale, bias), case)

    def unfused(x, weight, scale, bias, *rest):
        qkv = triton_ops.fp8_linear(x, weight, scale, bias).view(rows, -1, d)
        return triton_ops.rotary_kv_append(*qkv.split([hq, hk, hk], dim=1), *rest)

    fp8 = torch.float8_e4m3fn
    exact_x = Fp8Rows(_small_integers(rows, hidden, dtype=torch.float32).to(fp8), x_scale, dtype)
    exact_w = _small_integers(n, hidden, dtype=torch.float32).to(fp8)
    exact_bias = _small_integers(n, dtype=dtype) if with_bias else None
    got = run(triton_ops.fp8_linear_rotary_kv_append, exact_x, exact_w, exact_bias)
    assert got[0].shape == (rows, hq, d) and got[0].dtype == dtype
    want = run(unfused, exact_x, exact_w, exact_bias)
    assert torch.equal(got[2], want[2])  # v: the same scaled product, rounded once, in its slots
    for got_part, want_part in zip(got[:2], want[:2]):  # q and k: rotary may contract into FMAs differently
        torch.testing.assert_close(got_part, want_part, **ROTARY_TOL[dtype])

    # quantized by the reference (the Triton quantizer has its own tests, and the interpreter rounds
    # to fp8 wrongly where rounding carries)
    x = Fp8Rows(*reference.quantize_fp8_per_token(torch.randn(rows, hidden, device=DEVICE).to(dtype)), dtype)
    weight = (torch.randn(n, hidden, device=DEVICE) * 100).clamp(-448, 448).to(fp8)
    scale = w_scale / 2**10 / (hidden / 300) ** 0.5  # outputs of order one, as the tolerances assume
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    got = run(triton_ops.fp8_linear_rotary_kv_append, x, weight, bias, scale)
    want = run(reference.fp8_linear_rotary_kv_append, x, weight, bias, scale)
    tol = TOL[dtype if rows <= 16 else torch.bfloat16]  # past 16 rows scaled_mm, which writes bfloat16
    for got_part, want_part in zip(got, want):
        torch.testing.assert_close(got_part.float(), want_part.float(), **tol)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_fused_qkv_rotary_replays_in_a_cuda_graph() -> None:
    """Every replay gives the eager q and writes the eager k and v."""
    from mii_server.kernels import triton_ops

    hidden, hq, hk, d = QKV_SHAPE
    x = torch.randn(3, hidden, device=DEVICE, dtype=torch.bfloat16)
    weight = (torch.randn((hq + 2 * hk) * d, hidden, device=DEVICE) / hidden**0.5).to(torch.bfloat16)
    cos_sin = _cos_sin(64, d)
    positions = torch.tensor([5, 17, 63], device=DEVICE)
    slots = torch.tensor([3, 40, 2], device=DEVICE)
    k_cache, v_cache = (torch.zeros(4, 16, hk, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    eager = triton_ops.linear_rotary_kv_append(x, weight, None, positions, cos_sin, k_cache, v_cache, slots)
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = triton_ops.linear_rotary_kv_append(x, weight, None, positions, cos_sin, k_cache, v_cache, slots)
    for _ in range(3):
        replayed.zero_()
        k_cache.zero_()
        v_cache.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager) and torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)
