"""Pre-quantized fp8 checkpoints of a tiny model, written by the libraries that define the formats.

- ``write_fine_grained_fp8``: Hugging Face's fine-grained fp8 (``quant_method: "fp8"``), each decoder
  linear quantized by transformers' own ``Fp8Quantize`` op (what ``from_pretrained`` runs when it
  quantizes on the fly, which it refuses to do without a GPU), block-wise ``weight_scale_inv``.
- ``write_compressed_tensors_fp8``: compressed-tensors' ``FP8_DYNAMIC`` (per-channel) or ``FP8``
  (per-tensor weights, static activation scales) presets, as llm-compressor saves them: the scheme
  applied with ``apply_quantization_config``, weight scales from the library's ``calculate_qparams``
  (llm-compressor's observers do the same min/max), then ``ModelCompressor`` compresses and writes
  ``quantization_config``. The LM head is left unquantized (llm-compressor's usual ``ignore``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _copy_tokenizer(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)


def write_fine_grained_fp8(src: Path, out: Path, block: tuple[int, int] | None = (16, 16)) -> Path:
    """``src``'s decoder linears as HF fine-grained fp8 with ``block``-shaped weight scales (None: one
    scale per tensor)."""
    from safetensors.torch import load_file, save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    config = FineGrainedFP8Config(weight_block_size=block)
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(config))
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        linear = ".layers." in name and name.endswith("proj.weight")
        tensors.update(quantize.convert({name: tensor}) if linear else {name: tensor})
    _copy_tokenizer(src, out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config = json.loads((src / "config.json").read_text())
    hf_config["quantization_config"] = config.to_dict()
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    return out


def write_compressed_tensors_fp8(src: Path, out: Path, preset: str = "FP8_DYNAMIC") -> Path:
    """``src`` compressed by compressed-tensors with the ``preset`` scheme (FP8_DYNAMIC or FP8)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=["lm_head"], quantization_status=QuantizationStatus.CALIBRATION
    )
    apply_quantization_config(model, config)
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        w = module.weight.detach()
        if args.strategy == "channel":
            low, high = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        else:
            low, high = w.amin(), w.amax()
        scale, _ = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "input_scale"):  # static activations: a calibrated scale (unused by us)
            module.input_scale.data.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    _copy_tokenizer(src, out)
    return out
