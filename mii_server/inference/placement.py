"""Step 4 of init_inference: where the model runs, and moving it there."""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger(__name__)


def target_device(model: nn.Module, keep_module_on_host: bool) -> torch.device:
    """This rank's device: the CPU with ``keep_module_on_host`` or without CUDA; else the GPU of
    ``LOCAL_RANK`` (torchrun), else the one GPU the model already sits on, else the current GPU."""
    if keep_module_on_host or not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None:
        return torch.device("cuda", int(local_rank) % torch.cuda.device_count())
    on_gpus = {p.device for p in model.parameters() if p.device.type == "cuda"}
    if len(on_gpus) == 1:
        return on_gpus.pop()
    return torch.device("cuda", torch.cuda.current_device())


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def place(model: nn.Module, device: torch.device) -> None:
    """Move ``model`` to ``device`` in place. A model built on the meta device is materialised there
    with ``to_empty`` and initialised by its own ``init_weights`` (so buffers such as rotary
    frequencies hold their values); its weights are then the model's initialisation, to be loaded."""
    if has_meta_tensors(model):
        model.to_empty(device=device)
        init = getattr(model, "init_weights", None)
        if callable(init):
            init()
        log.warning("the model was on the meta device: materialised on %s with initial weights", device)
        return
    model.to(device)
