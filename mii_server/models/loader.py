"""Find a checkpoint, build its model family for one tensor-parallel rank, stream in the weights."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..errors import InvalidRequest
from .parallel import TensorParallelGroup
from .registry import model_class_for
from .spec import ArchitectureSpec

log = logging.getLogger(__name__)


def resolve_model_path(name_or_path: str) -> Path:
    """A local checkpoint directory, or a hub id resolved through the Hugging Face cache
    (downloaded when the network allows)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
        try:
            return Path(snapshot_download(name_or_path, allow_patterns=patterns, local_files_only=True))
        except Exception:  # noqa: BLE001 - not cached (or no hub cache at all): try the network
            return Path(snapshot_download(name_or_path, allow_patterns=patterns))
    except Exception as err:  # noqa: BLE001 - every hub failure becomes one clear error below
        raise InvalidRequest(
            f"{name_or_path!r} is neither a local directory nor a model the Hugging Face hub cache "
            f"holds or could fetch ({type(err).__name__}: {err})"
        ) from None


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files, from a sharded index when there is one."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InvalidRequest(f"no *.safetensors weights in {path}")
    return files


def iterate_weights(files: list[Path], show_progress: bool) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) for every tensor; slices read only what the loader indexes."""
    bar = tqdm(total=len(files), desc="Loading safetensors checkpoint shards", disable=not show_progress)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle is not a dict
                yield name, f.get_slice(name)
        bar.update(1)
    bar.close()


@dataclass
class LoadedModel:
    model: torch.nn.Module
    spec: ArchitectureSpec
    path: Path
    dtype: torch.dtype
    device: torch.device


def pick_dtype(name: str, device: torch.device, hf_config: Any) -> torch.dtype:
    """``auto``: float32 on the CPU; on a GPU the checkpoint's own half precision (its config's
    ``dtype``/``torch_dtype``), bfloat16 when it names none or float32."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    saved = getattr(torch, saved) if isinstance(saved, str) else saved
    return saved if saved in (torch.float16, torch.bfloat16) else torch.bfloat16


def load_model(
    path: Path,
    dtype_name: str,
    device: torch.device,
    tp: TensorParallelGroup | None = None,
    quantization_mode: str | None = None,
) -> LoadedModel:
    """Build the model family named by ``config.json`` for ``tp``'s rank and load its shard
    (quantized per ``quantization_mode`` or the checkpoint's own ``quantization_config``)."""
    from transformers import AutoConfig

    from .. import quantization

    tp = tp or TensorParallelGroup()
    hf_config = AutoConfig.from_pretrained(str(path))
    model_cls = model_class_for(hf_config.model_type)
    spec = model_cls.spec_from_config(hf_config)
    dtype = pick_dtype(dtype_name, device, hf_config)
    scheme = quantization.resolve_scheme(hf_config, quantization_mode, device)
    from ..kernels import get_ops

    with torch.device(device):
        model = model_cls(spec, tp, dtype, get_ops(device))
    show = tp.rank == 0 and os.environ.get("MII_SERVER_PROGRESS", "1") != "0"
    weights = iterate_weights(safetensors_files(path), show)
    if scheme is not None:
        quantization.quantize_model(model, scheme, device)
        weights = quantization.checkpoint_tensors(weights, scheme)
    model.load_weights(weights)
    model.eval()
    log.info("loaded %s (%s, %d layers) on %s as %s", path, spec.model_type, spec.num_layers, device, dtype)
    return LoadedModel(model=model, spec=spec, path=path, dtype=dtype, device=device)
