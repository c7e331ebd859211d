"""Triton twins of the row-wise reference ops: RMSNorm and SiLU- and GELU-and-mul (each also with its
output quantized per token for the fp8 linear that reads it), rotary embedding fused with the KV
append, and the plain KV append.

Each op matches ``reference`` in signature and rounding: intermediate values are rounded to the input
dtype exactly where the reference rounds them, so results agree to the last bit up to fp32
summation order. Inputs need a contiguous last dimension; other strides are passed to the kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_prologue
from .reference_quant import FP8_DTYPE, FP8_MAX, FP8_SCALE_FLOOR, Fp8Rows


@triton.jit
def to_fp8(y, scale, MAX: tl.constexpr):
    """fp32 values divided by their row's scale, clamped to +-MAX and rounded to fp8 e4m3.

    why div_rn: the reference divides in IEEE fp32; an approximate division would move values across
    fp8 rounding boundaries."""
    return tl.clamp(tl.math.div_rn(y, scale), -MAX, MAX).to(tl.float8e4nv)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    weight_ptr,
    out_ptr,
    stream_ptr,
    scale_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_stream,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr,
    FP8_FLOOR: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    # why before the wait: the weight is no kernel's output (see pdl.py), so its read overlaps the
    # previous kernel's tail
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0)
        # why: the reference adds in the input dtype, then normalises the rounded stream
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(stream_ptr + row * stride_stream + cols, x, mask=ok)
    h = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    normed = (h * inv).to(dtype).to(tl.float32) * w
    if QUANTIZE:  # the row quantized per token, as quantize_fp8_per_token does to the rounded output
        y = normed.to(dtype).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), FP8_FLOOR) / FP8_LIMIT
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * stride_out + cols, to_fp8(y, scale, FP8_LIMIT), mask=ok)
    else:
        tl.store(out_ptr + row * stride_out + cols, normed.to(dtype), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with an optional fused residual add; see ``reference.rms_norm``."""
    out, _, stream = _rms_norm(x, weight, eps, residual, quantize=False)
    return out.view(x.shape), stream


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[Fp8Rows, torch.Tensor]:
    """RMSNorm quantized for an fp8 linear in the same launch; see ``reference.rms_norm_fp8``."""
    out, scale, stream = _rms_norm(x, weight, eps, residual, quantize=True)
    return Fp8Rows(out, scale, x.dtype), stream


def _rms_norm_warps(rows: int, block: int) -> int:
    """Warps of the norm's program per row: 512 columns a warp, or 256 for a lone row (batch-1 decode,
    one program on the GPU, so its latency is the step's): 16 warps at Llama-3-8B's 4,096 columns took
    0.006-0.007 ms off an fp8 token against 8 (0.2%; bf16 unchanged, 32 warps no better), on an H100
    (docs/BENCHMARKS.md 2026-12-07, twenty-eighth session)."""
    return min(16, max(1, block // (256 if rows == 1 else 512)))


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, quantize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed [T, H] in x's dtype or fp8, float32 scales [T] (empty unless quantized), stream)."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)  # [T, H]
    out = torch.empty(x2.shape, dtype=FP8_DTYPE if quantize else x.dtype, device=x.device)
    scale = torch.empty(x2.shape[0] if quantize else 0, dtype=torch.float32, device=x.device)
    if residual is None:
        res2, stream2, stream = x2, x2, x
    else:
        res2 = residual.reshape(-1, hidden)
        stream2 = torch.empty_like(x2)
        stream = stream2.view(x.shape)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, stream2, scale,
            x2.stride(0), res2.stride(0), out.stride(0), stream2.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, QUANTIZE=quantize, FP8_FLOOR=FP8_SCALE_FLOOR, FP8_LIMIT=FP8_MAX,
            BLOCK=block, num_warps=_rms_norm_warps(x2.shape[0], block), **pdl_launch(x.device),
        )  # fmt: skip
    return out, scale, stream


@triton.jit
def _tanh(x):
    """tanh from exp (no tanh in tl.math on every Triton version); saturates to +-1 without NaN."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _act_and_mul_tile(x_ptr, cols, ok, inter, GELU_TANH: tl.constexpr):
    """act(gate) * up of one row's columns ``cols``, rounded as torch rounds it, in float32."""
    gate = tl.load(x_ptr + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + inter + cols, mask=ok, other=0.0)
    return act_and_mul_values(gate, up, GELU_TANH)


@triton.jit
def act_and_mul_values(gate, up, GELU_TANH: tl.constexpr):
    """act(gate) * up of 16-bit values, rounded as torch rounds it, in float32."""
    g = gate.to(tl.float32)
    if GELU_TANH:  # torch's gelu(approximate="tanh"): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
        act = 0.5 * g * (1.0 + _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    else:
        act = g / (1.0 + tl.exp(-g))
    # why: torch rounds act(gate) to the input dtype before the product, and the product after it
    act = act.to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype).to(tl.float32)


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, inter, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    y = _act_and_mul_tile(x_ptr + row * stride_x, cols, ok, inter, GELU_TANH)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _act_and_mul_fp8_kernel(
    x_ptr, out_ptr, scale_ptr, stride_x, stride_out, inter,
    GELU_TANH: tl.constexpr, FLOOR: tl.constexpr, MAX: tl.constexpr, BLOCK: tl.constexpr, WHOLE_ROW: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """A program per row: the row's absmax over act(gate) * up, then the product quantized. WHOLE_ROW
    (BLOCK covers the row): the product is held in registers between the two, so x is read once;
    otherwise it is computed again in a second pass over BLOCK-column spans."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if WHOLE_ROW:
        cols = tl.arange(0, BLOCK)
        ok = cols < inter
        y = _act_and_mul_tile(x_row, cols, ok, inter, GELU_TANH)
        scale = tl.maximum(tl.max(tl.abs(y), 0), FLOOR) / MAX
        tl.store(scale_ptr + row, scale)
        tl.store(out_ptr + row * stride_out + cols, to_fp8(y, scale, MAX), mask=ok)
        return
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, inter, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_act_and_mul_tile(x_row, cols, cols < inter, inter, GELU_TANH)))
    scale = tl.maximum(tl.max(amax, 0), FLOOR) / MAX
    tl.store(scale_ptr + row, scale)
    for c0 in range(0, inter, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < inter
        y = _act_and_mul_tile(x_row, cols, ok, inter, GELU_TANH)
        tl.store(out_ptr + row * stride_out + cols, to_fp8(y, scale, MAX), mask=ok)


# act_and_mul_fp8 holds a row of up to this many columns in registers (32 values a thread at one warp
# per 1,024 columns); a wider row takes two passes of ACT_PASS_BLOCK columns
ACT_WHOLE_ROW_MAX = 32768
ACT_PASS_BLOCK = 4096


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and inter > 0:
        block = min(1024, triton.next_power_of_2(inter))
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _act_and_mul_kernel[grid](
            x2, out, x2.stride(0), out.stride(0), inter, GELU_TANH=gelu_tanh, BLOCK=block, **pdl_launch(x.device)
        )
    return out.view(*x.shape[:-1], inter)


def _act_and_mul_fp8(x: torch.Tensor, gelu_tanh: bool) -> Fp8Rows:
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    out = torch.empty((x2.shape[0], inter), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    rows = x2.shape[0]
    if rows == 0 or inter == 0:
        return Fp8Rows(out, scale, x.dtype)
    width = triton.next_power_of_2(inter)
    whole_row = width <= ACT_WHOLE_ROW_MAX
    block = width if whole_row else ACT_PASS_BLOCK
    warps = max(1, block // 1024) if whole_row else ACT_PASS_BLOCK // 512
    _act_and_mul_fp8_kernel[(rows,)](
        x2, out, scale, x2.stride(0), out.stride(0), inter, GELU_TANH=gelu_tanh, FLOOR=FP8_SCALE_FLOOR, MAX=FP8_MAX,
        BLOCK=block, WHOLE_ROW=whole_row, num_warps=warps, **pdl_launch(x.device),
    )  # fmt: skip
    return Fp8Rows(out, scale, x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] holding gate then up projections -> silu(gate) * up: [T, I]."""
    return _act_and_mul(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU: x: [T, 2I] holding gate then up -> gelu_tanh(gate) * up: [T, I]."""
    return _act_and_mul(x, gelu_tanh=True)


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Rows:
    """``silu_and_mul`` quantized for an fp8 linear in the same launch; see ``reference.silu_and_mul_fp8``."""
    return _act_and_mul_fp8(x, gelu_tanh=False)


def gelu_tanh_and_mul_fp8(x: torch.Tensor) -> Fp8Rows:
    """``gelu_tanh_and_mul`` quantized for an fp8 linear; see ``reference.gelu_tanh_and_mul_fp8``."""
    return _act_and_mul_fp8(x, gelu_tanh=True)


@triton.jit
def _copy_heads(src, dst, stride_src_h, stride_dst_h, num_heads, width, HEADS_PAD: tl.constexpr, W_PAD: tl.constexpr):
    """Copy ``width`` values of each of ``num_heads`` heads from ``src`` to ``dst`` (cast to dst's dtype)."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    cols = tl.arange(0, W_PAD)[None, :]
    ok = (heads < num_heads) & (cols < width)
    x = tl.load(src + heads * stride_src_h + cols, mask=ok)
    tl.store(dst + heads * stride_dst_h + cols, x.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _rotate_heads(
    src, dst, stride_src_h, stride_dst_h, cos, sin, num_heads,
    HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, TAIL: tl.constexpr,
    TAIL_PAD: tl.constexpr,
):  # fmt: skip
    """Rotate-half the first 2 * HALF values of the ``num_heads`` heads of one token from ``src`` into
    ``dst`` (both at the token); the TAIL values after them (partial rotary) are copied unchanged."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    ok = (heads < num_heads) & (cols < HALF)
    x1 = tl.load(src + heads * stride_src_h + cols, mask=ok, other=0.0)
    x2 = tl.load(src + heads * stride_src_h + HALF + cols, mask=ok, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    # why two casts: the reference rounds to the input dtype, then to the destination's
    out_ty = dst.dtype.element_ty
    tl.store(dst + heads * stride_dst_h + cols, (a * cos - b * sin).to(x1.dtype).to(out_ty), mask=ok)
    tl.store(dst + heads * stride_dst_h + HALF + cols, (b * cos + a * sin).to(x1.dtype).to(out_ty), mask=ok)
    if TAIL > 0:
        _copy_heads(src + 2 * HALF, dst + 2 * HALF, stride_src_h, stride_dst_h, num_heads, TAIL, HEADS_PAD, TAIL_PAD)


@triton.jit
def _rotary_kv_append_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_cos_sin,
    num_q_heads, num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, TAIL: tl.constexpr,
    TAIL_PAD: tl.constexpr, QH_PAD: tl.constexpr, KH_PAD: tl.constexpr, D_PAD: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # why before the wait: positions, slots and the cos/sin table are no kernel's output in a step
    # (see pdl.py), so their reads overlap the previous kernel's tail
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + cols, mask=cols < HALF, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF + cols, mask=cols < HALF, other=0.0)[None, :]
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    pdl_prologue(PDL)
    _rotate_heads(
        q_ptr + tok * stride_qt, q_out_ptr + tok * stride_qot, stride_qh, stride_qoh, cos, sin,
        num_q_heads, QH_PAD, HALF, HALF_PAD, TAIL, TAIL_PAD,
    )  # fmt: skip
    if slot < 0:  # why: a negative slot marks a padding token (e.g. in a CUDA-graph batch)
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    _rotate_heads(
        k_ptr + tok * stride_kt, k_cache_ptr + block * stride_kcb + offset * stride_kcs, stride_kh, stride_kch,
        cos, sin, num_kv_heads, KH_PAD, HALF, HALF_PAD, TAIL, TAIL_PAD,
    )  # fmt: skip
    _copy_heads(
        v_ptr + tok * stride_vt, v_cache_ptr + block * stride_vcb + offset * stride_vcs, stride_vh, stride_vch,
        num_kv_heads, head_dim, KH_PAD, D_PAD,
    )  # fmt: skip


def rotary_kv_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k (the first ``cos_sin_cache.shape[-1]`` values of each head), write the rotated
    k and v into the cache; one launch, a program per token. Returns the rotated q. See
    ``reference.rotary_kv_append``."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    for t in (q, k, v, k_cache, v_cache, cos_sin_cache):
        assert t.stride(-1) == 1, "the last dimension must be contiguous"
    half = cos_sin_cache.shape[-1] // 2
    tail = head_dim - 2 * half
    _rotary_kv_append_kernel[(num_tokens,)](
        q, k, v, q_out, k_cache, v_cache, positions, slot_mapping, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), cos_sin_cache.stride(0),
        num_q_heads, num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        TAIL=tail,
        TAIL_PAD=triton.next_power_of_2(max(tail, 1)),
        QH_PAD=triton.next_power_of_2(num_q_heads),
        KH_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
        **pdl_launch(q.device),
    )  # fmt: skip
    return q_out


@triton.jit
def _kv_append_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, KH_PAD: tl.constexpr, D_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # a padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    _copy_heads(
        k_ptr + tok * stride_kt, k_cache_ptr + block * stride_kcb + offset * stride_kcs, stride_kh, stride_kch,
        num_kv_heads, head_dim, KH_PAD, D_PAD,
    )  # fmt: skip
    _copy_heads(
        v_ptr + tok * stride_vt, v_cache_ptr + block * stride_vcb + offset * stride_vcs, stride_vh, stride_vch,
        num_kv_heads, head_dim, KH_PAD, D_PAD,
    )  # fmt: skip


def kv_append(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key and value into its cache slot (models without rotary, e.g. OPT);
    one launch, no host sync. See ``reference.kv_append``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    for t in (k, v, k_cache, v_cache):
        assert t.stride(-1) == 1, "the last dimension must be contiguous"
    _kv_append_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1], KH_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim), **pdl_launch(k.device),
    )  # fmt: skip
