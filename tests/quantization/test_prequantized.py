"""Pre-quantized fp8 checkpoints load without a flag; other quantization formats are refused by name.

On the CPU (no fp8 tensor cores) fp8 checkpoints run through the reference ops, which dequantize the
fp8 weights and quantize activations per token exactly as the GPU kernels do. Measured greedy
agreement with the unquantized model the checkpoint was made from (16 prompts x 16 tokens):
hf-fp8-block (llama) 7/16 identical, 15/16 first token, 196/256 positions; hf-fp8-tensor (llama3)
5/16, 16/16, 165/256; ct-fp8-channel (qwen2) 11/16, 16/16, 235/256; ct-fp8-tensor (llama) 6/16,
16/16, 173/256.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import mii_server
from mii_server.errors import InvalidRequest, UnsupportedModel
from mii_server.kernels.reference_quant import dequantize_weight
from mii_server.models import load_model
from mii_server.models.parallel import TensorParallelGroup
from mii_server.quantization import QuantizedColumnParallelLinear, QuantizedRowParallelLinear
from mii_server.quantization.quantize import quantize_fp8

from .agreement import agreement, greedy

CPU = torch.device("cpu")
# name -> (scale shape of layer 0's gate_up_proj [rows, groups], least first-token agreement of 16)
EXPECTED = {
    "hf-fp8-block": ((256, 4), 14),
    "hf-fp8-tensor": ((256, 1), 14),
    "ct-fp8-channel": ((256, 1), 15),
    "ct-fp8-tensor": ((256, 1), 14),
}


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (QuantizedColumnParallelLinear, QuantizedRowParallelLinear))]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_fp8_checkpoint_loads_without_a_flag(name: str, prequantized_checkpoints) -> None:
    path, source = prequantized_checkpoints[name]
    model = load_model(path, "auto", CPU).model
    original = load_model(source, "float32", CPU).model
    layers = _layers(model)
    assert len(layers) == 4 * model.spec.num_layers
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    assert model.lm_head.weight.dtype == model.embed_tokens.weight.dtype == torch.float32
    assert tuple(model.layers[0].mlp.gate_up_proj.weight_scale.shape) == EXPECTED[name][0]
    # the scales are read the way the format means them: dequantized weights are the originals to
    # within fp8's rounding (3 mantissa bits), block by block, row by row
    wanted = {n: p for n, p in original.named_parameters() if n.endswith("proj.weight")}
    for layer_name, layer in model.named_modules():
        if layer in layers:
            got = dequantize_weight(layer.weight, layer.weight_scale, torch.float32)
            want = wanted[f"{layer_name}.weight"]
            assert ((got - want).abs() <= 2**-4 * want.abs() + layer.weight_scale.max() * 2**-9).all(), layer_name


def test_compressed_tensors_channel_scales_equal_load_time_fp8(prequantized_checkpoints) -> None:
    """llm-compressor's per-channel fp8 and our load-time fp8 quantizer agree code for code."""
    path, source = prequantized_checkpoints["ct-fp8-channel"]
    ours = load_model(path, "auto", CPU).model.layers[1].mlp.down_proj
    rows = load_model(source, "float32", CPU).model.layers[1].mlp.down_proj.weight
    codes, scale = quantize_fp8(rows.float(), 0, rows.shape[1])
    torch.testing.assert_close(ours.weight_scale, scale, atol=0, rtol=1e-6)
    assert (ours.weight.float() != codes.float()).float().mean() < 0.01  # a scale one ulp apart moves a few


@pytest.mark.parametrize("name", list(EXPECTED))
def test_fp8_checkpoint_greedy_agreement(name: str, prequantized_checkpoints) -> None:
    path, source = prequantized_checkpoints[name]
    measured = agreement(greedy(str(source)), greedy(str(path)))
    print(f"{name}: {measured}")
    assert measured.first_token >= EXPECTED[name][1], str(measured)
    assert measured.positions >= 0.55 * measured.prompts * 16, str(measured)


def test_fp8_checkpoint_shards_block_scales_over_ranks(prequantized_checkpoints) -> None:
    """With 2 ranks, each row-parallel shard keeps its columns' scale blocks, each column-parallel
    shard its rows' (the blocks are expanded to rows before the split)."""
    path, _ = prequantized_checkpoints["hf-fp8-block"]
    whole = load_model(path, "auto", CPU).model.layers[0].mlp
    ranks = [load_model(path, "auto", CPU, TensorParallelGroup(r, 2)).model.layers[0].mlp for r in (0, 1)]
    down = whole.down_proj  # row parallel: [64, 128] weight, [64, 8] scales of 16 columns
    assert torch.equal(torch.cat([r.down_proj.weight_scale for r in ranks], dim=1), down.weight_scale)
    assert torch.equal(torch.cat([r.down_proj.weight.float() for r in ranks], dim=1), down.weight.float())
    gate, up = whole.gate_up_proj.weight_scale.chunk(2)
    for rank, shard in enumerate(ranks):
        assert torch.equal(shard.gate_up_proj.weight_scale, torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]))


def _with_quantization_config(source: Path, out: Path, config: dict) -> Path:
    shutil.copytree(source, out)
    hf_config = json.loads((out / "config.json").read_text())
    hf_config["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(hf_config))
    return out


@pytest.mark.parametrize(
    "config",
    [
        {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"},
        {"quant_method": "gptq", "bits": 4, "group_size": 128},
        {"quant_method": "bitsandbytes", "load_in_4bit": True},
    ],
    ids=["awq", "gptq", "bitsandbytes"],
)
def test_other_quantization_formats_are_refused(config: dict, tiny_checkpoints, tmp_path: Path) -> None:
    path = _with_quantization_config(tiny_checkpoints["llama"], tmp_path / "ckpt", config)
    with pytest.raises(UnsupportedModel, match=f"'{config['quant_method']}' are not supported.*fine-grained fp8"):
        mii_server.pipeline(str(path))


def test_compressed_tensors_int4_weights_are_refused(tiny_checkpoints, tmp_path: Path) -> None:
    group = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": group}}
    path = _with_quantization_config(tiny_checkpoints["llama"], tmp_path / "ckpt", config)
    with pytest.raises(UnsupportedModel, match="compressed-tensors checkpoint with format 'pack-quantized'"):
        mii_server.pipeline(str(path))


def test_a_mode_cannot_requantize_an_fp8_checkpoint(prequantized_checkpoints) -> None:
    path, _ = prequantized_checkpoints["ct-fp8-channel"]
    with pytest.raises(InvalidRequest, match="already quantized to fp8"):
        mii_server.pipeline(str(path), quantization_mode="int8")
