"""Phi-3: the Llama decoder whose checkpoint stores q/k/v and gate/up fused (our packed layout, read
one shard at a time); partial rotary and a sliding window come from its config."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .checkpoint import consecutive_parts
from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_parts(self, name: str, source: Any, shard: Any) -> Iterable[tuple[Any, Any]]:
        s = self.spec
        if ".qkv_proj." in name:
            q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
            return consecutive_parts(source, [q, kv, kv])
        if ".gate_up_proj." in name:
            return consecutive_parts(source, [s.intermediate_size, s.intermediate_size])
        return super().checkpoint_parts(name, source, shard)
