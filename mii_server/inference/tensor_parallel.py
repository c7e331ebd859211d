"""Step 2 of init_inference: tensor parallelism of a Hugging Face model's own decoder layers.

Megatron's split, as DeepSpeed's automatic tensor parallelism does it: in every decoder layer, the
linear layers that produce the attention heads and the MLP's hidden units are split by output
(column-parallel, no communication), and the ones that consume them (the output projections) are split
by input and their partial sums all-reduced (row-parallel). The replacements are mii_server's own
``ColumnParallelLinear`` / ``RowParallelLinear``. Which linear is which comes from the user's
``injection_policy`` (layer class -> names of its row-parallel linears; every other linear of the layer
is column-parallel) or, without one, from the layer names of the families we know. Attention modules
that store their head count or width (``num_heads``, ``embed_dim``, GPT-2's ``split_size``...) get
this rank's share. Embeddings and the LM head stay whole on every rank.

Kernel-injected families skip this step: their layers are built sharded by ``injection``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..errors import InvalidRequest, UnsupportedModel
from ..models.layers import ColumnParallelLinear, RowParallelLinear, even_shard
from ..models.parallel import TensorParallelGroup
from ..tensor_parallel.distributed import init_tensor_parallel, torchrun_rank

log = logging.getLogger(__name__)

# Linear layer names (the last part of a module's name) of the decoder families transformers ships
ROW_PARALLEL = frozenset({"o_proj", "out_proj", "down_proj", "c_proj", "fc2", "fc_out", "dense", "dense_4h_to_h",
                          "wo", "w2"})  # fmt: skip
COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "fc_in", "c_fc",
                             "dense_h_to_4h", "wq", "wk", "wv", "w1", "w3", "query", "key", "value",
                             "c_attn", "W_pack", "qkv_proj", "gate_up_proj"})  # fmt: skip
# Linears that pack equal parts (q, k, v or gate, up) into one output: each part is split on its own
PACKED_PARTS = {"c_attn": 3, "W_pack": 3, "qkv_proj": 3, "gate_up_proj": 2}
# Attributes of attention modules that count heads or their width, divided by the ranks
HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "num_kv_heads")
WIDTH_ATTRS = ("embed_dim", "all_head_size", "split_size", "inner_dim", "hidden_size")


def tensor_parallel_group(tp_size: int, device: torch.device) -> TensorParallelGroup:
    """This process's rank of a ``tp_size``-rank group over torch.distributed's default group.

    The default group is initialised when the script has not done it (env:// under torchrun: NCCL on
    CUDA, gloo on the CPU); an initialised one must have exactly ``tp_size`` ranks.
    """
    if tp_size == 1:
        return TensorParallelGroup(device=str(device))
    import torch.distributed as dist

    if dist.is_initialized():
        world = dist.get_world_size()
        if world != tp_size:
            raise InvalidRequest(
                f"tensor_parallel tp_size={tp_size}, but torch.distributed has {world} ranks"
            )
        return TensorParallelGroup(rank=dist.get_rank(), size=tp_size, device=str(device))
    ranks = torchrun_rank()
    if ranks is None or ranks[2] != tp_size:
        raise InvalidRequest(
            f"tensor_parallel tp_size={tp_size} needs {tp_size} processes: run the script with "
            f"`torchrun --nproc-per-node {tp_size} script.py`"
            + ("" if ranks is None else f" (this launcher started {ranks[2]})")
        )
    return init_tensor_parallel(ranks[0], tp_size, device, init_method="env://")


def is_linear(module: nn.Module) -> bool:
    """nn.Linear, or transformers' Conv1D (GPT-2's linear layer with a transposed weight)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _weight(module: nn.Module) -> torch.Tensor:
    """The layer's weight as [out_features, in_features]."""
    return module.weight.t() if type(module).__name__ == "Conv1D" else module.weight


def column_parallel(module: nn.Module, tp: TensorParallelGroup, parts: int = 1) -> ColumnParallelLinear:
    """This rank's output rows of ``module`` (each of its ``parts`` packed outputs split on its own)."""
    weight = _weight(module).detach()  # [out, in]
    out, inp = weight.shape
    if out % (parts * tp.size):
        raise InvalidRequest(f"{out} output features in {parts} part(s) do not split over {tp.size} ranks")
    part = out // parts
    bias = module.bias is not None
    with torch.device(weight.device):
        new = ColumnParallelLinear(inp, [even_shard(part, tp)] * parts, tp, bias=bias, dtype=weight.dtype)
    for i in range(parts):
        new.weight.weight_loader(new.weight, weight.narrow(0, i * part, part), i)  # type: ignore[attr-defined]
        if bias:
            new.bias.weight_loader(new.bias, module.bias.detach().narrow(0, i * part, part), i)  # type: ignore[attr-defined]
    return new


def row_parallel(module: nn.Module, tp: TensorParallelGroup) -> RowParallelLinear:
    """This rank's input columns of ``module``; its partial outputs are all-reduced (then the bias added)."""
    weight = _weight(module).detach()
    out, inp = weight.shape
    if inp % tp.size:
        raise InvalidRequest(f"{inp} input features do not split over {tp.size} ranks")
    bias = module.bias is not None
    with torch.device(weight.device):
        new = RowParallelLinear(inp, out, tp, bias=bias, dtype=weight.dtype)
    new.weight.weight_loader(new.weight, weight)  # type: ignore[attr-defined]
    if bias:
        new.bias.weight_loader(new.bias, module.bias.detach())  # type: ignore[attr-defined]
    return new


def _policy_key_matches(key: Any, module: nn.Module) -> bool:
    return type(module) is key if isinstance(key, type) else type(module).__name__ == key


def decoder_layers(
    model: nn.Module, policy: dict[Any, tuple[str, ...]] | None
) -> list[tuple[nn.Module, tuple[str, ...] | None]]:
    """(layer, its row-parallel names or None for automatic) for every decoder layer to shard.

    With a policy: every module of a named class. Without: the elements of each list of identical
    modules holding linear layers (``model.layers``, GPT-2's ``transformer.h``...), outermost lists only.
    """
    if policy is not None:
        found: list[tuple[nn.Module, tuple[str, ...] | None]] = []
        for key, rows in policy.items():
            matched = [m for m in model.modules() if _policy_key_matches(key, m)]
            if not matched:
                name = key.__name__ if isinstance(key, type) else key
                raise InvalidRequest(
                    f"injection_policy names {name}, but the model has no module of that class"
                )
            found += [(m, rows) for m in matched]
        return found
    layers: list[tuple[nn.Module, tuple[str, ...] | None]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in taken):
            continue  # inside a layer already taken (e.g. a mixture of experts' list)
        repeated = (
            isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(m) for m in module}) == 1
        )
        if repeated and any(is_linear(m) for m in module[0].modules()):
            layers += [(m, None) for m in module]
            taken.append(name)
    if not layers:
        raise UnsupportedModel(
            f"{type(model).__name__}: no repeated decoder layers found to shard; pass injection_policy"
        )
    return layers


def classify(layer: nn.Module, rows: tuple[str, ...] | None) -> dict[str, str]:
    """Qualified linear name (inside ``layer``) -> "row" or "column".

    ``rows``: the policy's row-parallel names (matched as the name or its dotted suffix; each must
    match); None classifies by the known names and raises ``UnsupportedModel`` naming the rest.
    """
    plan: dict[str, str] = {}
    unknown: list[str] = []
    for name, module in layer.named_modules():
        if not is_linear(module):
            continue
        last = name.rsplit(".", 1)[-1]
        if rows is not None:
            plan[name] = "row" if any(name == r or name.endswith("." + r) for r in rows) else "column"
        elif last in ROW_PARALLEL:
            plan[name] = "row"
        elif last in COLUMN_PARALLEL:
            plan[name] = "column"
        else:
            unknown.append(name)
    if unknown:
        raise UnsupportedModel(
            f"{type(layer).__name__}: cannot tell how to split the linear layer(s) {', '.join(unknown)}; pass "
            "injection_policy={LayerClass: (names of its output projections, ...)}"
        )
    if rows is not None:
        missing = [r for r in rows if not any(n == r or n.endswith("." + r) for n in plan)]
        if missing:
            raise InvalidRequest(
                f"injection_policy for {type(layer).__name__} names {', '.join(missing)}, which is no linear "
                f"layer of it (its linear layers: {', '.join(plan)})"
            )
    return plan


def _check_heads(config: Any, tp: TensorParallelGroup) -> None:
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    for what, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if isinstance(count, int) and count % tp.size:
            raise InvalidRequest(
                f"the model's {count} {what} do not split over tensor_parallel tp_size={tp.size}"
            )


def _scale_attributes(module: nn.Module, tp: TensorParallelGroup) -> None:
    """Give an attention module that stores its head count and width this rank's share of them."""
    if not any(isinstance(getattr(module, a, None), int) for a in HEAD_ATTRS):
        return
    for attr in HEAD_ATTRS + WIDTH_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            if value % tp.size:
                raise InvalidRequest(
                    f"{type(module).__name__}.{attr}={value} does not split over {tp.size} ranks"
                )
            setattr(module, attr, value // tp.size)


def shard_model(model: nn.Module, tp: TensorParallelGroup, policy: dict[Any, tuple[str, ...]] | None) -> int:
    """Replace the linear layers of ``model``'s decoder layers by this rank's shards, in place.

    Returns the number of linear layers replaced.
    """
    _check_heads(getattr(model, "config", None), tp)
    packed_gqa = getattr(getattr(model, "config", None), "num_key_value_heads", None)
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    replaced = 0
    for layer, rows in decoder_layers(model, policy):
        plan = classify(layer, rows)
        parents: dict[int, nn.Module] = {}
        for name, kind in plan.items():
            parent_name, _, child = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            old = getattr(parent, child)
            if kind == "row":
                new: nn.Module = row_parallel(old, tp)
            else:
                parts = PACKED_PARTS.get(child, 1)
                if parts == 3 and packed_gqa is not None and heads is not None and packed_gqa != heads:
                    raise UnsupportedModel(
                        f"{name} packs q, k and v of unequal sizes (grouped-query attention)"
                    )
                new = column_parallel(old, tp, parts)
            setattr(parent, child, new)
            parents[id(parent)] = parent
            replaced += 1
        for parent in parents.values():
            _scale_attributes(parent, tp)
    log.info("tensor parallel rank %d/%d: %d linear layers sharded", tp.rank, tp.size, replaced)
    return replaced
