"""FP6 e3m2 (MII's ``wf6af16`` weights): the number format, its encoder, and the packed layout.

A code is 6 bits: sign (bit 5), a 3-bit exponent with bias 3 (bits 4-2), a 2-bit mantissa (bits 1-0).
Exponent 0 is subnormal (``m / 4 * 2**-2``), the others normal (``(1 + m / 4) * 2**(e - 3)``); there is
no infinity or NaN, so the 32 magnitudes run 0, 0.0625, ... 24, 28 in code order.

Packed layout (per weight row of K codes, K divisible by 4; K4 = K / 4): the codes of columns
``i, i + K4, i + 2 K4, i + 3 K4`` share three bytes, one in each of three planes of K4 bytes that lie
side by side in the row (``[plane 0 | plane 1 | plane 2]``, 3 K4 bytes, i.e. 6 bits a weight). Byte
``i`` of plane ``p`` holds the code of column ``i + p K4`` in its high 6 bits and two bits of the code
of column ``i + 3 K4`` in its low 2 bits (plane 0: that code's bits 5-4, plane 1: bits 3-2, plane 2:
bits 1-0). A GEMM tile reads the same K4-range from the three planes and gets four tiles of codes,
each a contiguous range of columns: no bit shuffles across bytes, no gather.

Decoding to fp16 is one shift and a bitcast: ``((c & 0x1F) << 8) | ((c & 0x20) << 10)`` is an fp16
whose value is the code's times ``2**-12`` (the exponent bias differs by 12 and fp16's subnormals
cover e3m2's), so a kernel folds ``FP6_FP16_FACTOR`` into the per-channel scale.
"""

from __future__ import annotations

import torch

FP6_MAX = 28.0  # largest e3m2 magnitude: (1 + 3/4) * 2**4
FP6_FP16_FACTOR = 4096.0  # e3m2 value = bitcast-fp16 value * 2**12


def fp6_magnitudes() -> torch.Tensor:
    """float32 [32]: the value of each non-negative code 0..31 (ascending)."""
    e = torch.arange(32) >> 2
    m = (torch.arange(32) & 3).float()
    return torch.where(e == 0, m / 4 * 0.25, (1 + m / 4) * torch.exp2(e.float() - 3))


def fp6_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [64]: the value of every code (codes 32..63 are the negatives of 0..31)."""
    mags = fp6_magnitudes()
    return torch.cat((mags, -mags)).to(device)


def fp6_encode(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes of the e3m2 values nearest to ``x`` (|x| <= FP6_MAX expected; larger saturates).

    Rounds to nearest; a value exactly halfway between two magnitudes goes to the smaller one."""
    mags = fp6_magnitudes().to(x.device)
    midpoints = (mags[1:] + mags[:-1]) / 2  # [31]
    magnitude = torch.bucketize(x.abs().float(), midpoints, right=False)  # 0..31
    sign = (x < 0).to(torch.uint8) << 5
    return magnitude.to(torch.uint8) | sign


def pack_fp6(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] codes (K divisible by 4) -> uint8 [N, 3 K / 4] in the plane layout above."""
    n, k = codes.shape
    if k % 4:
        raise ValueError(f"FP6 packing needs a multiple of 4 input columns, not {k}")
    a, b, c, d = codes.reshape(n, 4, k // 4).unbind(1)  # each [N, K4]
    planes = ((a << 2) | (d >> 4), (b << 2) | ((d >> 2) & 3), (c << 2) | (d & 3))
    return torch.cat(planes, dim=1)


def unpack_fp6(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 3 K / 4] packed -> uint8 [N, K] codes (the inverse of ``pack_fp6``)."""
    n, k3 = packed.shape
    p0, p1, p2 = packed.reshape(n, 3, k3 // 3).unbind(1)  # each [N, K4]
    d = ((p0 & 3) << 4) | ((p1 & 3) << 2) | (p2 & 3)
    return torch.cat((p0 >> 2, p1 >> 2, p2 >> 2, d), dim=1)
