"""``init_inference(model, config=None, **kwargs)``: DeepSpeed's wrapper for a transformers model, on our parts.

The steps, in DeepSpeed's order, all in place on ``model``:

1. dtype conversion (``dtype``; int8 keeps the dtype and quantizes the injected layers' linears to
   weight-only int8 in step 3);
2. tensor parallelism (``tensor_parallel``): the process group from torch.distributed, initialised
   when absent; the model's own layers sharded Megatron-style (``tensor_parallel.shard_model``), unless
   step 3 builds them sharded;
3. kernel injection (``replace_with_kernel_inject``): llama-family decoders swapped for ours;
4. device placement: this rank's GPU, or the CPU (``keep_module_on_host``, or no CUDA); a meta-device
   model is materialised with ``to_empty``;
5. CUDA graphs of the injected decode step (``enable_cuda_graph``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import InvalidRequest
from ..models.parallel import TensorParallelGroup
from .config import InferenceConfig
from .cuda_graph import DecodeGraphs, check_graphs_possible
from .decoder import InjectedDecoder
from .dtype import convert_dtype, weight_quantization
from .injection import inject_kernels, require_injectable
from .placement import has_meta_tensors, place, target_device
from .tensor_parallel import shard_model, tensor_parallel_group

log = logging.getLogger(__name__)


class InferenceEngine(nn.Module):
    """The wrapped model: ``engine.module`` is it; ``engine(...)`` / ``engine.generate(...)`` are its
    ``forward`` and ``generate``, taking and returning what they do (under ``torch.no_grad``)."""

    def __init__(self, module: nn.Module, config: InferenceConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.tp = tp

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def injected(self) -> InjectedDecoder | None:
        """The kernel-injected decoder inside ``module``, if kernels were injected."""
        return next((m for m in self.module.modules() if isinstance(m, InjectedDecoder)), None)

    def _on_device(self, values: dict[str, Any]) -> dict[str, Any]:
        device = self.device
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device = self.device
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        with torch.no_grad():
            return self.module(*args, **self._on_device(kwargs))

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers ``generate`` of the wrapped model (tensor arguments moved to its device)."""
        device = self.device
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        with torch.no_grad():
            return self.module.generate(*args, **self._on_device(kwargs))


def init_inference(
    model: nn.Module, config: InferenceConfig | dict[str, Any] | str | Path | None = None, **kwargs: Any
) -> InferenceEngine:
    """Wrap a transformers model for inference on mii_server's kernels; see the module docstring.

    ``config``: a dict, a JSON file's path or an InferenceConfig; ``kwargs`` (DeepSpeed's keys) take
    precedence. Unknown keys raise ``UnknownArgument``, bad values ``InvalidRequest``, a model the
    requested steps cannot handle ``UnsupportedModel``. The model is modified in place. Under tensor
    parallelism every rank calls this (and then ``generate``) alike, as under DeepSpeed.
    """
    cfg = InferenceConfig.resolve(config, kwargs)
    if not isinstance(model, nn.Module):
        raise InvalidRequest(f"init_inference wraps a torch.nn.Module, not {type(model).__name__}")
    inject = cfg.replace_with_kernel_inject
    if inject:
        require_injectable(model)
    if has_meta_tensors(model) and (inject or cfg.tp_size > 1):
        raise InvalidRequest(
            "a meta-device model has no weights to shard or copy into injected kernels: load its weights "
            "first (or use it with tp_size=1 and replace_with_kernel_inject=False)"
        )
    device = target_device(model, cfg.keep_module_on_host)
    model.eval()
    model.requires_grad_(False)
    quantization = weight_quantization(cfg.dtype, inject)
    convert_dtype(model, cfg.dtype)  # 1. dtype
    tp = tensor_parallel_group(cfg.tp_size, device)  # 2. tensor parallelism
    if cfg.enable_cuda_graph:
        check_graphs_possible(device, inject, tp)
    if tp.size > 1 and not inject:
        shard_model(model, tp, cfg.injection_policy)
    elif inject and cfg.injection_policy is not None:
        log.info(
            "injection_policy is not used: the injected layers of %s shard themselves", type(model).__name__
        )
    decoder = inject_kernels(model, tp, device, cfg.max_out_tokens, quantization) if inject else None  # 3.
    place(model, device)  # 4. device
    if cfg.enable_cuda_graph and decoder is not None:  # 5. CUDA graphs, captured on first use
        decoder.graphs = DecodeGraphs(decoder.decode_step, device)
    return InferenceEngine(model, cfg, tp)
