"""Random-weight checkpoints of real model shapes for the GPU benchmarks, written fast.

The weights are drawn on the GPU when there is one (std 0.02, norms 1) and saved as sharded
safetensors, so both mii-server's loader and Hugging Face transformers read them. The tokenizer is
word-level over the whole vocabulary ("t0 " ... "t{V-1} "), so a prompt of n ids is the text
``word_text(ids)`` and tokenises back to exactly those n ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

LLAMA3_8B: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 0,
    "eos_token_id": 1, "pad_token_id": 2,
}  # fmt: skip

# Mixtral-8x7B's shape (8 experts of 14336, top 2; 32 / 8 heads); benchmarks cut num_hidden_layers
MIXTRAL_8X7B: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
    "rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_local_experts": 8, "num_experts_per_tok": 2,
    "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    "pad_token_id": 2,
}  # fmt: skip


def word_text(ids: list[int]) -> str:
    """The text that the word-level tokenizer turns into exactly ``ids``."""
    return "".join(f"t{i} " for i in ids)


def _decoder_tensors(cfg: Any) -> tuple[dict[str, tuple[int, ...]], int, int]:
    """Name -> shape of the embedding, head, final norm and every layer's attention and norms; with
    the hidden and intermediate sizes."""
    h, v = cfg.hidden_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    tensors: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                           "lm_head.weight": (v, h)}  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        }  # fmt: skip
    return tensors, h, cfg.intermediate_size


def write_random_llama(out: Path, shape: dict[str, Any] = LLAMA3_8B, shards: int = 4) -> Path:
    """Write config, weights and tokenizer of a random Llama of ``shape`` (reused when present)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**shape)
    tensors, h, inter = _decoder_tensors(cfg)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        tensors |= {p + "gate_proj.weight": (inter, h), p + "up_proj.weight": (inter, h), p + "down_proj.weight": (h, inter)}
    return write_random_checkpoint(out, cfg, tensors, shards)


def write_random_mixtral(out: Path, shape: dict[str, Any], shards: int = 8) -> Path:
    """Write config, weights and tokenizer of a random Mixtral of ``shape``, in the hub's per-expert
    layout (``block_sparse_moe.experts.E.w1/w2/w3``), reused when present."""
    from transformers import MixtralConfig

    cfg = MixtralConfig(**shape)
    tensors, h, inter = _decoder_tensors(cfg)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.block_sparse_moe."
        tensors[p + "gate.weight"] = (cfg.num_local_experts, h)
        for e in range(cfg.num_local_experts):
            x = f"{p}experts.{e}."
            tensors |= {x + "w1.weight": (inter, h), x + "w3.weight": (inter, h), x + "w2.weight": (h, inter)}
    return write_random_checkpoint(out, cfg, tensors, shards)


def write_random_checkpoint(out: Path, cfg: Any, tensors: dict[str, tuple[int, ...]], shards: int) -> Path:
    """Random bf16 ``tensors`` (name -> shape; 1-d ones are norms, set to 1) as sharded safetensors,
    with ``cfg`` and a word-level tokenizer over its vocabulary; reused when already written."""
    from safetensors.torch import save_file

    if (out / "model.safetensors.index.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = list(tensors)
    gen = torch.Generator(device=device).manual_seed(0)
    weight_map: dict[str, str] = {}
    per_shard = -(-len(names) // shards)
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        for name in names[s * per_shard : (s + 1) * per_shard]:
            size = tensors[name]
            if len(size) == 1:
                part[name] = torch.ones(size, dtype=torch.bfloat16)
            else:
                part[name] = (torch.randn(size, device=device, generator=gen, dtype=torch.bfloat16) * 0.02).cpu()
            weight_map[name] = file
        save_file(part, str(out / file), metadata={"format": "pt"})
        del part
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg.save_pretrained(str(out))
    word_level_tokenizer(cfg.vocab_size).save_pretrained(str(out))
    return out


def word_level_tokenizer(vocab_size: int) -> Any:
    """The checkpoints' tokenizer: "t0 " ... "t{V-1} ", one word one id (``word_text``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i} ": i for i in range(vocab_size)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0 "))
    words.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")  # "t5 t9 " -> "t5 ", "t9 "
    return PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="t0 ", eos_token="t1 ", pad_token="t2 ", unk_token="t0 "
    )
