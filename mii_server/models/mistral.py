"""Mistral: the Llama decoder with grouped-query attention and an (optional) sliding window.

The window caps the context (ArchitectureSpec.max_positions), within which attention is full.
"""

from __future__ import annotations

from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    qkv_bias = False
