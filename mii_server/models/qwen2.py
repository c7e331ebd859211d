"""Qwen2: the Llama decoder with biases on the q, k and v projections."""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
