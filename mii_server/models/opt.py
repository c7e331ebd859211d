"""OPT (pre-LayerNorm variants): LayerNorm, ReLU, biases, learned positions (offset 2), no rotary.

Refused: post-LayerNorm OPT-350m (do_layer_norm_before=False) and its word_embed_proj_dim projections,
LayerNorms without affine weights, and a removed final LayerNorm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModel
from ..kernels import AttentionMetadata
from .blocks import LayerNormDecoderLayer
from .checkpoint import CheckpointNames
from .layers import LayerNorm, _copy
from .llama import LlamaForCausalLM
from .parallel import TensorParallelGroup
from .spec import ArchitectureSpec

_POSITION_OFFSET = 2  # OPT's learned positions start at row 2 (a fairseq legacy)


class LearnedPositions(nn.Module):
    """A replicated table of learned position embeddings; position p reads row p + 2."""

    def __init__(self, max_positions: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_positions + _POSITION_OFFSET, hidden, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = lambda p, s, shard_id=0: _copy(p, s[:])  # type: ignore[attr-defined]

    def forward(self, positions: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return nn.functional.embedding(positions + _POSITION_OFFSET, self.weight)


class OPTForCausalLM(LlamaForCausalLM):
    layer_cls = LayerNormDecoderLayer
    norm_cls = LayerNorm
    checkpoint_names = CheckpointNames(
        prefixes=("model.decoder.", "model."),
        renames=(
            (r"^final_layer_norm\.", "norm."),
            (r"\.self_attn_layer_norm\.", ".input_layernorm."),
            (r"\.final_layer_norm\.", ".post_attention_layernorm."),
            (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
            (r"\.fc1\.", ".mlp.fc1."),
            (r"\.fc2\.", ".mlp.fc2."),
        ),
    )

    @classmethod
    def spec_from_config(cls, config: Any) -> ArchitectureSpec:
        missing = [
            what
            for what, unsupported in (
                ("post-LayerNorm blocks (do_layer_norm_before=False, e.g. OPT-350m)", not config.do_layer_norm_before),
                ("word_embed_proj_dim projections", config.word_embed_proj_dim != config.hidden_size),
                ("LayerNorms without weights (layer_norm_elementwise_affine=False)",
                 not config.layer_norm_elementwise_affine),
                ("a removed final LayerNorm (_remove_final_layer_norm)", getattr(config, "_remove_final_layer_norm", False)),
            )
            if unsupported
        ]  # fmt: skip
        if missing:
            raise UnsupportedModel(f"OPT with {' and '.join(missing)} is not supported")
        bias = config.enable_bias
        return (
            super()
            .spec_from_config(config)
            .replace(
                num_kv_heads=config.num_attention_heads,
                intermediate_size=config.ffn_dim,
                rms_norm_eps=1e-5,  # nn.LayerNorm's default: OPT's config names none
                qkv_bias=bias,
                o_bias=bias,
                mlp_bias=bias,
                hidden_act=config.activation_function,
                rotary_dim=0,
            )
        )

    def __init__(self, spec: ArchitectureSpec, tp: TensorParallelGroup, dtype: torch.dtype, ops: Any) -> None:
        super().__init__(spec, tp, dtype, ops)
        self.embed_positions = LearnedPositions(spec.max_positions, spec.hidden_size, dtype)

    def embed(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.embed_tokens(input_ids) + self.embed_positions(meta.positions)
