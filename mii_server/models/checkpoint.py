"""From checkpoint tensor names to our parameters: renames, packed matrices and fused rows.

Our parameter names are the same in every family (``layers.N.self_attn.qkv_proj``,
``layers.N.mlp.gate_up_proj``, ``layers.N.mlp.experts.w13`` ...); a family only states how its
checkpoint names differ (``CheckpointNames``). Separate q/k/v and gate/up tensors land in their shard
of our packed matrices; per-expert tensors land in their expert's slice of the stacked expert
weights; tensors a checkpoint stores fused (Phi-3's qkv_proj, Falcon's query_key_value) are read
through ``RowRuns`` views, one per packed shard, so each rank still reads only its own rows.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .layers import shape_of

# checkpoint parameter -> (our packed parameter, its shard)
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_PACKED_NAME = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")
_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class CheckpointNames:
    """How a family's checkpoint names its tensors, relative to our parameter names."""

    prefixes: tuple[str, ...] = ("model.",)  # stripped from the front of every name
    renames: tuple[tuple[str, str], ...] = ()  # (regex, replacement), applied in order after the prefix
    skip: tuple[str, ...] = ("rotary_emb",)  # tensors whose names contain any of these are not loaded
    embedding: str = "embed_tokens.weight"  # also loaded into lm_head.weight when embeddings are tied

    def parameter(self, hf_name: str) -> tuple[str, Any]:
        """(our parameter name, shard id for its ``weight_loader``) of a checkpoint tensor."""
        name = hf_name
        for prefix in self.prefixes:
            name = name.removeprefix(prefix)
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)
        expert = _EXPERT_NAME.search(name)
        if expert:
            index, part = int(expert.group(1)), expert.group(2)
            base = name[: expert.start()] + ".experts."
            return (base + "w2", index) if part == "down_proj" else (base + "w13", (index, part == "up_proj"))
        packed = _PACKED_NAME.search(name)
        if packed:
            ours, shard = _PACKED[packed.group(1)]
            return name.replace(f".{packed.group(1)}.", f".{ours}."), shard
        return name, 0


class RowRuns:
    """Runs of rows (start, length) of a checkpoint tensor, stacked in order, read lazily.

    Behaves like a safetensors slice for the loaders in ``layers``: ``get_shape()`` and indexing
    with slices; a read touches only the runs it overlaps.
    """

    def __init__(self, source: Any, runs: Sequence[tuple[int, int]]) -> None:
        self.source = source
        self.runs = list(runs)
        self.rest = shape_of(source)[1:]

    def get_shape(self) -> list[int]:
        return [sum(n for _, n in self.runs), *self.rest]

    def __getitem__(self, key: Any) -> torch.Tensor:
        key = key if isinstance(key, tuple) else (key,)
        first, others = key[0], key[1:]
        start, stop, step = first.indices(self.get_shape()[0])
        assert step == 1, "only contiguous row ranges are read"
        pieces, offset = [], 0
        for run_start, length in self.runs:
            lo, hi = max(start, offset), min(stop, offset + length)
            if lo < hi:
                pieces.append(self.source[(slice(run_start + lo - offset, run_start + hi - offset), *others)])
            offset += length
        return torch.cat(pieces) if len(pieces) != 1 else pieces[0]


def consecutive_parts(source: Any, sizes: Sequence[int]) -> list[tuple[RowRuns, int]]:
    """(view, shard id) per packed shard of a tensor that stores them one after another."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(RowRuns(source, [(start, size)]), i) for i, (start, size) in enumerate(zip(starts, sizes))]


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, Any]], tie_embeddings: bool) -> None:
    """Copy checkpoint tensors (name, tensor or safetensors slice) into ``model``'s parameters,
    through ``model.checkpoint_names`` and ``model.checkpoint_parts``.

    Raises ValueError naming a tensor that matches no parameter, or parameters left unloaded.
    """
    names: CheckpointNames = model.checkpoint_names
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, source in weights:
        if any(part in hf_name for part in names.skip):
            continue
        name, shard = names.parameter(hf_name)
        targets = [name, "lm_head.weight"] if tie_embeddings and name == names.embedding else [name]
        for target in targets:
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {hf_name} matches no parameter of {type(model).__name__}")
            for view, shard_id in model.checkpoint_parts(target, source, shard):
                param.weight_loader(param, view, shard_id)
            loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:4])}")
