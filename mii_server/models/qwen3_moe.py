"""Qwen3-MoE: Qwen3's attention with routed experts (no shared expert; ``norm_topk_prob``)."""

from __future__ import annotations

from .moe import MoEDecoderLayer
from .qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    layer_cls = MoEDecoderLayer
