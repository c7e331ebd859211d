"""Qwen2-MoE: Qwen2's attention (q/k/v biases) with routed experts plus a sigmoid-gated shared expert."""

from __future__ import annotations

from .moe import MoEDecoderLayer
from .qwen2 import Qwen2ForCausalLM


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    layer_cls = MoEDecoderLayer
