"""Step 3 of init_inference: kernel injection for the families mii_server implements (llama, mistral, qwen2).

The model's base model (``model.model``) is replaced by an ``InjectedDecoder`` whose layers are
mii_server's own (``models.llama.LlamaDecoderLayer``, built for this rank's tensor-parallel shard) with
the weights copied from the transformers layers, one layer at a time so the copy costs one layer of
memory. The model's embedding and LM head are kept; under tensor parallelism they are replaced by
mii_server's vocabulary-parallel embedding and LM head (logits gathered whole on every rank).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModel
from ..kernels import get_ops
from ..models.checkpoint import CheckpointNames
from ..models.layers import ParallelLMHead, RMSNorm, VocabParallelEmbedding, rope_cos_sin_cache
from ..models.llama import LlamaDecoderLayer
from ..models.parallel import TensorParallelGroup
from ..models.registry import MODEL_FAMILIES
from ..quantization import QuantScheme, quantize_linears
from .decoder import InjectedDecoder

log = logging.getLogger(__name__)

# why these three: their decoder layers are models.llama's LlamaDecoderLayer as is
INJECTABLE_FAMILIES = frozenset({"llama", "mistral", "qwen2"})
_LAYER_NAMES = CheckpointNames(prefixes=())  # a decoder layer's own state dict: no model prefix


def injectable(model: nn.Module) -> bool:
    """Whether ``model`` is a ...ForCausalLM of a family with our kernels (its base model holds layers)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    return model_type in INJECTABLE_FAMILIES and hasattr(base, "layers") and hasattr(model, "lm_head")


def require_injectable(model: nn.Module) -> None:
    if not injectable(model):
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise UnsupportedModel(
            f"replace_with_kernel_inject: {type(model).__name__} (model_type {model_type!r}) has no injected "
            f"kernels; supported: the ...ForCausalLM of {', '.join(sorted(INJECTABLE_FAMILIES))}. Use "
            "replace_with_kernel_inject=False (tensor parallelism still works, through injection_policy)"
        )


def load_layer(ours: LlamaDecoderLayer, hf_layer: nn.Module) -> None:
    """Copy a transformers decoder layer's weights into ours (this rank's shard); q/k/v and gate/up
    land in our packed matrices through the same name map as checkpoint loading."""
    params = dict(ours.named_parameters())
    loaded: set[str] = set()
    for name, tensor in hf_layer.state_dict().items():
        if "rotary_emb" in name:
            continue
        name, shard_id = _LAYER_NAMES.parameter(name)
        param = params.get(name)
        if param is None:
            raise UnsupportedModel(
                f"{type(hf_layer).__name__} has a weight {name} our decoder layer does not"
            )
        param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise UnsupportedModel(f"{type(hf_layer).__name__} lacks the weights {', '.join(missing)}")


class GatheredLMHead(nn.Module):
    """Vocabulary-parallel LM head with transformers' interface: [..., hidden] -> [..., vocab] logits
    in the hidden states' dtype, gathered whole on every rank."""

    def __init__(self, head: ParallelLMHead) -> None:
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden.reshape(-1, hidden.shape[-1]))  # float32 [N, vocab]
        return logits.to(hidden.dtype).view(*hidden.shape[:-1], logits.shape[-1])


def _vocab_parallel(
    cls: type[VocabParallelEmbedding], weight: torch.Tensor, tp: TensorParallelGroup, device: torch.device
) -> Any:
    vocab, hidden = weight.shape
    with torch.device(device):
        layer = cls(vocab, hidden, tp, weight.dtype)
    layer.weight.weight_loader(layer.weight, weight.detach())  # type: ignore[attr-defined]
    return layer


def inject_kernels(
    model: nn.Module,
    tp: TensorParallelGroup,
    device: torch.device,
    max_out_tokens: int,
    quantization: QuantScheme | None = None,
) -> InjectedDecoder:
    """Swap ``model``'s base model for an InjectedDecoder on ``device``, in place; returns the decoder.
    With ``quantization``, each layer's linears are quantized twins (quantized as their weights are copied)."""
    require_injectable(model)
    config = model.config
    family = MODEL_FAMILIES[config.model_type]
    spec = family.spec_from_config(config)
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix)
    dtype = base.embed_tokens.weight.dtype
    ops = get_ops(device)
    layers = nn.ModuleList()
    for i in range(len(base.layers)):
        with torch.device(device):
            ours = LlamaDecoderLayer(spec, i, tp, dtype, ops)
            if quantization is not None:
                quantize_linears(ours, quantization, ops)
        load_layer(ours, base.layers[i])
        layers.append(ours)
        base.layers[i] = nn.Module()  # why: drop the transformers layer now, so only one layer is doubled
    with torch.device(device):
        norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, ops)
    norm.weight.weight_loader(norm.weight, base.norm.weight.detach())  # type: ignore[attr-defined]
    embed: nn.Module = base.embed_tokens
    if tp.size > 1:
        tied = model.lm_head.weight is base.embed_tokens.weight
        head_weight = model.lm_head.weight
        embed = _vocab_parallel(VocabParallelEmbedding, base.embed_tokens.weight, tp, device)
        model.lm_head = GatheredLMHead(_vocab_parallel(ParallelLMHead, head_weight, tp, device))
        if tied:  # one shard serves both, as the tied weights did
            model.lm_head.head.weight = embed.weight
    cos_sin = rope_cos_sin_cache(spec.rotary_dim, spec.max_positions, spec.rope_theta, spec.rope_scaling)
    decoder = InjectedDecoder(config, spec, embed, layers, norm, cos_sin.to(device), max_out_tokens)
    setattr(model, prefix, decoder)
    log.info(
        "kernel injection: %d %s layers on %s (rank %d/%d)",
        spec.num_layers,
        spec.model_type,
        device,
        tp.rank,
        tp.size,
    )
    return decoder
