"""Mistral: the Llama decoder with grouped-query attention and an (optional) sliding window.

The window (``sliding_window``, every layer) is masked in attention: a token sees the last
``sliding_window`` positions, itself included.
"""

from __future__ import annotations

from .llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    qkv_bias = False
