"""The sampler's spread argmax (``triton_argmax.argmax_rows``) gives what ``torch.argmax(dim=-1)`` gives:
the first column of the maximum, NaN above every number, -0.0 equal to 0.0, on vocabularies that do
and do not fill their last chunk."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from mii_server.kernels import triton_argmax, triton_ops

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
BLOCK = triton_argmax.BLOCK


def _check(x: torch.Tensor) -> None:
    got = triton_ops.argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == x.shape[:1]
    assert torch.equal(got.cpu(), x.cpu().argmax(dim=-1))


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("vocab", [5, BLOCK, 3 * BLOCK + 7, 128256 if ON_GPU else 2 * BLOCK + 1])
def test_random_rows(rows: int, vocab: int) -> None:
    torch.manual_seed(rows * vocab)
    _check(torch.randn(rows, vocab, device=DEVICE))


def test_ties_pick_the_first_column_across_chunks() -> None:
    x = torch.zeros(4, 3 * BLOCK, device=DEVICE)
    x[0, [BLOCK + 5, 5, 2 * BLOCK]] = 7.0  # the earliest column sits in the first chunk
    x[1, [2 * BLOCK + 1, BLOCK + 3]] = 7.0
    x[2] = -1.0  # every column ties: column 0
    x[3, :] = float("-inf")  # all -inf: column 0, as torch
    _check(x)


def test_nan_wins_and_negative_zero_equals_zero() -> None:
    x = torch.full((3, 2 * BLOCK + 3), -5.0, device=DEVICE)
    x[0, [BLOCK + 9, 3]] = float("inf")
    x[0, 2 * BLOCK + 1] = float("nan")  # NaN beats +inf, wherever it sits
    x[1, 7] = -0.0
    x[1, BLOCK + 2] = 0.0  # -0.0 first: it is the maximum's first column
    x[2, [4, BLOCK]] = float("nan")  # the first NaN
    _check(x)


def test_half_precision_and_strided_rows() -> None:
    torch.manual_seed(1)
    _check(torch.randn(3, BLOCK + 11, device=DEVICE).half())
    wide = torch.randn(4, 2 * BLOCK + 64, device=DEVICE)
    _check(wide[:, 32 : 32 + 2 * BLOCK])  # rows with a stride wider than their length
    _check(wide.t()[:7])  # columns not contiguous: torch's argmax serves it
