"""Mixtral: Mistral's attention with top-2-of-8 routed experts (softmax over all, top-k renormalised)."""

from __future__ import annotations

from .checkpoint import CheckpointNames
from .mistral import MistralForCausalLM
from .moe import MoEDecoderLayer


class MixtralForCausalLM(MistralForCausalLM):
    layer_cls = MoEDecoderLayer
    # block_sparse_moe.gate is the router; experts.E.w1 / w3 / w2 are gate / up / down
    checkpoint_names = CheckpointNames(
        renames=(
            (r"\.block_sparse_moe\.", ".mlp."),
            (r"\.w1\.weight$", ".gate_proj.weight"),
            (r"\.w3\.weight$", ".up_proj.weight"),
            (r"\.w2\.weight$", ".down_proj.weight"),
        )
    )
