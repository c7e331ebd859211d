"""Shared by the init_inference tests and their torchrun script: tiny models of families we have no
kernels for, and a left-padded batch of prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Numbers 0 1 2 3 café 東京 🙂",
    "A model server answers requests for text; ragged batching packs many sequences",
]
NEW_TOKENS = 16
VOCAB = 384  # the tiny tokenizer's vocabulary (mii_server.demo_model)
PAD = 3


def build_foreign(kind: str) -> Any:
    """A tiny random GPT-2 (Conv1D layers, packed q/k/v) or OPT (separate q/k/v, fc1/fc2), fp32."""
    from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                           bos_token_id=1, eos_token_id=1))  # fmt: skip
    else:
        model = OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                                         num_attention_heads=4, max_position_embeddings=128,
                                         word_embed_proj_dim=64, pad_token_id=PAD))  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:  # larger matrices than the default init: fewer tied and repeated tokens
                p.normal_(0.0, 0.2)
    return model.eval()


def save_foreign(root: Path) -> dict[str, Path]:
    paths = {}
    for kind in ("gpt2", "opt"):
        paths[kind] = root / kind
        build_foreign(kind).save_pretrained(str(paths[kind]))
    return paths


def padded_batch(path: Path, prompts: list[str] = PROMPTS) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask of ``prompts``, left-padded (as decoder-only generation wants)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    return dict(tok(prompts, return_tensors="pt", padding=True))


def generate_kwargs() -> dict[str, Any]:
    """Greedy, a fixed number of new tokens (EOS ignored, like the engine's ignore_eos)."""
    return {
        "max_new_tokens": NEW_TOKENS,
        "min_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "pad_token_id": PAD,
    }


def token_agreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """Share of generated tokens inside the rows' common prefixes (a greedy path that parts once,
    on a near-tie of the logits, never rejoins, so only the prefix is comparable)."""
    same = total = 0
    for g, w in zip(got.tolist(), want.tolist()):
        same += next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), len(w))
        total += len(w)
    return same / total
