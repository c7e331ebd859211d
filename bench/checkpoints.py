"""Random-weight checkpoints of real model shapes, written fast (weights drawn on the GPU when there is one).

Used by the GPU benchmarks: the model loads through mii-server's normal safetensors loader and
through Hugging Face transformers alike. The tokenizer is the demo model's small byte-level BPE
(ids beyond its vocabulary decode to nothing), so prompts are made of ids, not text.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}


def write_random_llama(out_dir: Path, shape: dict, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """Write config.json, sharded safetensors (one shard per 4 layers) and the demo tokenizer."""
    from transformers import LlamaConfig

    from mii_server.demo_model import train_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "model.safetensors.index.json").exists():
        return out_dir
    tokenizer = train_tokenizer(out_dir)
    config = LlamaConfig(
        **shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False
    )
    config.save_pretrained(str(out_dir))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * d

    def rand(*size: int) -> torch.Tensor:
        # std 0.02 like an initialised model; norms stay at 1 so activations keep a sane scale
        return (torch.randn(size, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype).cpu()

    weight_map: dict[str, str] = {}

    def flush(tensors: dict[str, torch.Tensor], name: str) -> None:
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    flush({"model.embed_tokens.weight": rand(v, h), "lm_head.weight": rand(v, h),
           "model.norm.weight": torch.ones(h, dtype=dtype)}, "embed.safetensors")  # fmt: skip
    layers = shape["num_hidden_layers"]
    for first in range(0, layers, 4):
        shard: dict[str, torch.Tensor] = {}
        for layer in range(first, min(first + 4, layers)):
            p = f"model.layers.{layer}."
            shard.update({
                p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                p + "mlp.down_proj.weight": rand(h, i),
                p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
            })  # fmt: skip
        flush(shard, f"layers-{first:02d}.safetensors")
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out_dir
