"""Qwen3: the Llama decoder with q and k RMS-normalised per head before rotary, and an explicit head_dim."""

from __future__ import annotations

from typing import Any

from .llama import LlamaForCausalLM
from .spec import ArchitectureSpec


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def spec_from_config(cls, config: Any) -> ArchitectureSpec:
        return super().spec_from_config(config).replace(qk_norm="rms")
