"""Fixtures of the CUDA tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with head size 64 and grouped-query attention (the Triton kernels' tl.dot tiles
    need head sizes of at least 16; the session's tiny checkpoints use 8 and 16)."""
    from mii_server.demo_model import build_tiny_checkpoint

    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("gpu") / "llama", "llama", seed=3, hidden_size=256, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
    )  # fmt: skip
