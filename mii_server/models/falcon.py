"""Falcon: LayerNorm, GELU, rotary, a fused query_key_value in kv-head groups; parallel attention and
MLP with one shared norm (Falcon-7B, multi-query) or one each (new_decoder_architecture, Falcon-40B),
or the sequential block (parallel_attn=False). ALiBi variants (Falcon-RW) are refused."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModel
from .blocks import LayerNormDecoderLayer, ParallelDecoderLayer
from .checkpoint import CheckpointNames, RowRuns
from .layers import LayerNorm
from .llama import LlamaForCausalLM
from .parallel import TensorParallelGroup
from .spec import ArchitectureSpec


class FalconForCausalLM(LlamaForCausalLM):
    norm_cls = LayerNorm
    checkpoint_names = CheckpointNames(
        prefixes=("transformer.",),
        renames=(
            (r"^word_embeddings\.", "embed_tokens."),
            (r"^h\.", "layers."),
            (r"^ln_f\.", "norm."),
            (r"\.self_attention\.query_key_value\.", ".self_attn.qkv_proj."),
            (r"\.self_attention\.dense\.", ".self_attn.o_proj."),
            (r"\.mlp\.dense_h_to_4h\.", ".mlp.fc1."),
            (r"\.mlp\.dense_4h_to_h\.", ".mlp.fc2."),
            (r"\.ln_attn\.", ".input_layernorm."),
            (r"\.ln_mlp\.", ".mlp_layernorm."),
        ),
    )

    @classmethod
    def spec_from_config(cls, config: Any) -> ArchitectureSpec:
        if config.alibi:
            raise UnsupportedModel("Falcon with ALiBi position biases (alibi=True, e.g. Falcon-RW) is not supported")
        new = config.new_decoder_architecture
        if new and not config.parallel_attn:
            raise UnsupportedModel("Falcon with new_decoder_architecture and parallel_attn=False is not supported")
        norms = (config.num_ln_in_parallel_attn or 2) if new else 1
        return (
            super()
            .spec_from_config(config)
            .replace(
                num_kv_heads=config.num_kv_heads if new or not config.multi_query else 1,
                intermediate_size=config.ffn_hidden_size,
                qkv_bias=config.bias,
                o_bias=config.bias,
                mlp_bias=config.bias,
                hidden_act=config.activation,
                parallel_block_norms=norms if config.parallel_attn else 0,
            )
        )

    def make_layer(
        self, spec: ArchitectureSpec, index: int, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any
    ) -> nn.Module:
        block = ParallelDecoderLayer if spec.parallel_block_norms else LayerNormDecoderLayer
        return block(spec, index, tp, dtype, ops)

    def checkpoint_parts(self, name: str, source: Any, shard: Any) -> Iterable[tuple[Any, Any]]:
        if ".qkv_proj." not in name:
            return super().checkpoint_parts(name, source, shard)
        # every layout is kv-head groups of (g query heads, 1 key, 1 value), g = Hq / Hk: multi-query
        # is one group, the original multi-head layout Hq groups of one query head each
        s = self.spec
        d, kv = s.head_dim, s.num_kv_heads
        g = s.num_heads // kv
        group_rows = (g + 2) * d
        q = [((h // g) * group_rows + (h % g) * d, d) for h in range(s.num_heads)]
        k = [(j * group_rows + g * d, d) for j in range(kv)]
        v = [(j * group_rows + (g + 1) * d, d) for j in range(kv)]
        return [(RowRuns(source, q), 0), (RowRuns(source, k), 1), (RowRuns(source, v), 2)]
