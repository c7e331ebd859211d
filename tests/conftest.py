"""Shared fixtures: tiny checkpoints built once per test session (no hub needed)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
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
    # a window shorter than most test prompts, so masking outside it is exercised
    "mistral": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {"num_key_value_heads": 4}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}),
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [1],  # layer 1 keeps a dense MLP
        },
    ),
    "qwen3": ("qwen3", {"head_dim": 32}),  # head_dim != hidden / heads
    "qwen3_moe": (
        "qwen3_moe",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True, "head_dim": 32},
    ),
    "phi3": ("phi3", {"sliding_window": 8, "partial_rotary_factor": 0.5}),
    "phi": ("phi", {"qk_layernorm": True}),  # partial rotary 0.5 is Phi's default
    "falcon": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2, "ffn_hidden_size": 128}),
    "falcon_7b": ("falcon", {"multi_query": True, "ffn_hidden_size": 128}),  # one KV head, one norm
    "falcon_sequential": (
        "falcon",
        {"multi_query": False, "parallel_attn": False, "bias": True, "ffn_hidden_size": 128},
    ),
    "opt": ("opt", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    "gemma2": (
        "gemma2",
        {
            "head_dim": 16,
            "sliding_window": 8,  # on layer 0 (layer_types alternate)
            "query_pre_attn_scalar": 16,
            "attn_logit_softcapping": 10.0,
            "final_logit_softcapping": 5.0,
        },
    ),
}


class TinyCheckpoints(Mapping[str, Path]):
    """name -> directory of a tiny random-weight checkpoint with its tokenizer, built on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.built: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        from mii_server.demo_model import build_tiny_checkpoint

        if name not in self.built:
            model_type, overrides = TINY_VARIANTS[name]
            seed = list(TINY_VARIANTS).index(name)
            self.built[name] = build_tiny_checkpoint(self.root / name, model_type, seed=seed, **overrides)
        return self.built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(TINY_VARIANTS)

    def __len__(self) -> int:
        return len(TINY_VARIANTS)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    """name -> directory of a tiny random-weight checkpoint with its tokenizer."""
    return TinyCheckpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model and deployment registry live in a per-session folder."""
    root = tmp_path_factory.mktemp("mii_cache")
    os.environ["MII_SERVER_CACHE"] = str(root)
    os.environ["MII_SERVER_REGISTRY"] = str(root / "deployments")
    return root
