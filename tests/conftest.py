"""Shared fixtures: tiny checkpoints built once per test session (no hub needed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("MII_SERVER_PROGRESS", "0")
# One compute thread per process: the tiny models gain nothing from more, and server tests run
# several processes on CI's two cores (inherited by every process the tests start).
os.environ.setdefault("OMP_NUM_THREADS", "1")

TINY_VARIANTS = {
    "llama": ("llama", {}),
    "llama3": (
        "llama",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": ("mistral", {"sliding_window": 4096}),
    "qwen2": ("qwen2", {"num_key_value_heads": 4}),
}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> directory of a tiny random-weight checkpoint with its tokenizer."""
    from mii_server.demo_model import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return {
        name: build_tiny_checkpoint(root / name, model_type, seed=i, **overrides)
        for i, (name, (model_type, overrides)) in enumerate(TINY_VARIANTS.items())
    }


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model and deployment registry live in a per-session folder."""
    root = tmp_path_factory.mktemp("mii_cache")
    os.environ["MII_SERVER_CACHE"] = str(root)
    os.environ["MII_SERVER_REGISTRY"] = str(root / "deployments")
    return root
