"""dtype="auto" picks float32 on the CPU and the checkpoint's half precision on a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mii_server.models.loader import pick_dtype

GPU, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(
    ("name", "device", "saved", "expected"),
    [
        ("auto", CPU, "float16", torch.float32),
        ("auto", GPU, "float16", torch.float16),
        ("auto", GPU, torch.bfloat16, torch.bfloat16),
        ("auto", GPU, "float32", torch.bfloat16),
        ("auto", GPU, None, torch.bfloat16),
        ("float16", CPU, "bfloat16", torch.float16),
    ],
)
def test_pick_dtype(name: str, device: torch.device, saved: object, expected: torch.dtype) -> None:
    assert pick_dtype(name, device, SimpleNamespace(dtype=saved)) == expected
