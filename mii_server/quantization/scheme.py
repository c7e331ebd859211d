"""Which quantized format the decoder's linear layers use, from ``quantization_mode`` or the checkpoint.

Two sources, one ``QuantScheme``:

- ``quantization_mode`` (MII's kwarg) on an unquantized checkpoint: the weights are quantized as
  they load, one scale per output channel: ``int8`` (weight-only int8), ``wf6af16`` (weight-only FP6
  e3m2) or ``fp8`` (e4m3 weights and per-token e4m3 activations; needs fp8 tensor cores).
- a pre-quantized checkpoint, recognised by ``config.json``'s ``quantization_config``: Hugging Face's
  fine-grained fp8 (``quant_method: "fp8"``, block-wise ``weight_scale_inv``) and compressed-tensors
  with fp8 weights (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK: per-tensor, per-channel or block
  ``weight_scale``). Every other method (AWQ, GPTQ, bitsandbytes, ...) is refused by name.

Activations of fp8 layers are always quantized per token at run time: a checkpoint's static
activation scales (``input_scale`` / ``activation_scale``) are not used.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from ..config import QuantizationMode
from ..errors import InvalidRequest, UnsupportedModel

log = logging.getLogger(__name__)

QUANTIZATION_MODES: tuple[str, ...] = get_args(QuantizationMode)
WeightFormat = Literal["int8", "fp6", "fp8"]
_FORMAT_OF_MODE: dict[str, WeightFormat] = {"fp8": "fp8", "int8": "int8", "wf6af16": "fp6"}
SUPPORTED_CHECKPOINTS = (
    "quant_method 'fp8' (Hugging Face fine-grained fp8) and 'compressed-tensors' with 8-bit float "
    "weights (llm-compressor FP8, FP8_DYNAMIC, FP8_BLOCK)"
)
FP8_GEMM_ENV = "MII_SERVER_FP8_GEMM"  # auto | triton | scaled_mm: which GEMM fp8 layers use on the GPU
_FP8_GEMMS = ("auto", "triton", "scaled_mm")


@dataclass(frozen=True)
class QuantScheme:
    """How the decoder's linear layers store their weights (the embedding and LM head keep the model
    dtype; on CUDA the head also gains an int8 copy, see ``lm_head``)."""

    weight_format: WeightFormat
    prequantized: bool  # weights and scales come from the checkpoint; else quantized as they load
    # (rows, columns) of a weight-scale block in the checkpoint; None: per tensor or per channel
    block: tuple[int, int] | None = None
    fp8_gemm: str = "auto"  # the GPU GEMM of fp8 layers: auto, triton or scaled_mm
    emulated: bool = False  # fp8 on a device without fp8 tensor cores: the reference ops dequantize
    origin: str = ""  # for logs: where the scheme came from

    @property
    def block_k(self) -> int | None:
        """Input columns per weight scale (None: one scale spans the whole row)."""
        return None if self.block is None else self.block[1]


def fp8_supported(device: torch.device) -> bool:
    """Whether ``device`` has fp8 tensor cores (CUDA compute capability 8.9: Ada, Hopper and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def resolve_scheme(hf_config: Any, mode: str | None, device: torch.device) -> QuantScheme | None:
    """The scheme for this checkpoint and ``quantization_mode`` on ``device``; None when unquantized.

    Raises ``UnsupportedModel`` for a quantization format that cannot load and for ``fp8`` on a device
    without fp8 tensor cores, ``InvalidRequest`` for an unknown mode or one that contradicts the
    checkpoint's own quantization.
    """
    if mode is not None and mode not in QUANTIZATION_MODES:
        raise InvalidRequest(f"quantization_mode {mode!r} is not one of {', '.join(QUANTIZATION_MODES)}")
    checkpoint = getattr(hf_config, "quantization_config", None)
    if checkpoint is not None and not isinstance(checkpoint, dict):
        checkpoint = checkpoint.to_dict()  # a transformers QuantizationConfigMixin
    fp8_gemm = os.environ.get(FP8_GEMM_ENV, "auto").lower()
    if fp8_gemm not in _FP8_GEMMS:
        raise InvalidRequest(f"{FP8_GEMM_ENV} must be one of {', '.join(_FP8_GEMMS)}, not {fp8_gemm!r}")
    if checkpoint:
        block = checkpoint_block(checkpoint)
        if mode not in (None, "fp8"):
            raise InvalidRequest(
                f"this checkpoint is already quantized to fp8; quantization_mode={mode!r} cannot re-quantize "
                "it (leave quantization_mode unset, or load an unquantized checkpoint)"
            )
        emulated = not fp8_supported(device)
        if emulated:
            log.warning(
                "%s has no fp8 tensor cores: the fp8 checkpoint runs through the reference ops, which "
                "dequantize each weight in every forward (correct, slow)", device
            )
        method = checkpoint.get("quant_method")
        return QuantScheme("fp8", True, block, fp8_gemm, emulated, origin=f"checkpoint ({method})")
    if mode is None:
        return None
    if mode == "fp8" and not fp8_supported(device):
        raise UnsupportedModel(
            f"quantization_mode='fp8' needs fp8 tensor cores (CUDA compute capability 8.9 or newer, e.g. "
            f"L4, H100, H200); {device} has none. int8 and wf6af16 run everywhere."
        )
    return QuantScheme(_FORMAT_OF_MODE[mode], False, None, fp8_gemm, origin=f"quantization_mode={mode}")


def checkpoint_block(config: dict[str, Any]) -> tuple[int, int] | None:
    """The weight-scale block of a supported fp8 ``quantization_config`` (None: per tensor or per
    channel); ``UnsupportedModel`` naming the supported formats for anything else."""
    method = config.get("quant_method")
    if method == "fp8":
        return _hf_fp8_block(config)
    if method == "compressed-tensors":
        return _compressed_tensors_block(config)
    raise UnsupportedModel(
        f"checkpoints quantized with quant_method {method!r} are not supported; pre-quantized checkpoints "
        f"that load: {SUPPORTED_CHECKPOINTS}. An unquantized checkpoint can be quantized at load with "
        f"quantization_mode={' | '.join(QUANTIZATION_MODES)}."
    )


def _hf_fp8_block(config: dict[str, Any]) -> tuple[int, int] | None:
    if config.get("scale_fmt", "float") != "float":
        raise UnsupportedModel(f"fine-grained fp8 with scale_fmt {config['scale_fmt']!r} is not supported (float is)")
    if config.get("modules_to_convert"):
        raise UnsupportedModel("fine-grained fp8 checkpoints with fp8 embeddings (modules_to_convert) are not supported")
    block = config.get("weight_block_size")
    return None if block is None else _block(block)


def _compressed_tensors_block(config: dict[str, Any]) -> tuple[int, int] | None:
    def refuse(what: str) -> UnsupportedModel:
        return UnsupportedModel(
            f"compressed-tensors checkpoint with {what} is not supported; supported: {SUPPORTED_CHECKPOINTS}"
        )

    if config.get("format") not in ("float-quantized", "naive-quantized"):
        raise refuse(f"format {config.get('format')!r}")
    if config.get("kv_cache_scheme"):
        raise refuse("a quantized KV cache (kv_cache_scheme)")
    if config.get("sparsity_config") or config.get("transform_config"):
        raise refuse("sparsity or transforms")
    blocks = set()
    for group in (config.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        kind = f"{weights.get('num_bits')}-bit {weights.get('type')} weights"
        if weights.get("num_bits") != 8 or weights.get("type") != "float" or not weights.get("symmetric", True):
            raise refuse(kind)
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise refuse(f"{strategy!r} weight scales")
        acts = group.get("input_activations")
        if acts and (acts.get("num_bits") != 8 or acts.get("type") != "float"):
            raise refuse(f"{acts.get('num_bits')}-bit {acts.get('type')} activations")
        blocks.add(_block(weights["block_structure"]) if strategy == "block" else None)
    if len(blocks) != 1:
        raise refuse("no config group, or groups with different weight-scale blocks")
    return blocks.pop()


def _block(block: Any) -> tuple[int, int]:
    rows, cols = (int(v) for v in block)
    if cols % 16:
        raise UnsupportedModel(f"fp8 weight-scale blocks of {cols} columns are not supported (a multiple of 16 is)")
    return rows, cols
