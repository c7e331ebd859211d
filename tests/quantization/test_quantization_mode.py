"""``quantization_mode`` int8 and wf6af16 on the tiny fp32 checkpoints of every family (CPU).

Agreement measured on these random-weight models (16 prompts x 16 greedy tokens; random weights give
near-tied logits, so one flipped token changes the rest of a sequence: a lower bound for real models):

| variant | int8: identical / first token / positions | wf6af16: identical / first token / positions |
|---|---|---|
| llama   | 14/16, 16/16, 243/256 | 3/16, 15/16, 166/256 |
| llama3  | 12/16, 16/16, 236/256 | 3/16, 15/16, 131/256 |
| mistral | 12/16, 16/16, 234/256 | 5/16, 15/16, 150/256 |
| qwen2   | 15/16, 16/16, 254/256 | 8/16, 13/16, 208/256 |
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from server.helpers import free_port_block

import mii_server
from mii_server.config import ModelConfig
from mii_server.errors import InvalidRequest, UnsupportedModel
from mii_server.models import load_model
from mii_server.models.parallel import TensorParallelGroup
from mii_server.quantization import QuantizedColumnParallelLinear, QuantizedRowParallelLinear

from .agreement import agreement, greedy

# the least agreement each mode must keep (measured figures in the module docstring)
FLOORS = {"int8": {"identical": 11, "first_token": 15}, "wf6af16": {"identical": 2, "first_token": 12}}


@pytest.fixture(scope="module")
def unquantized(tiny_checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {name: greedy(str(path)) for name, path in tiny_checkpoints.items()}


@pytest.mark.parametrize("mode", ["int8", "wf6af16"])
@pytest.mark.parametrize("variant", ["llama", "llama3", "mistral", "qwen2"])
def test_greedy_agreement(variant: str, mode: str, tiny_checkpoints: dict[str, Path], unquantized) -> None:
    measured = agreement(unquantized[variant], greedy(str(tiny_checkpoints[variant]), quantization_mode=mode))
    print(f"{variant} {mode}: {measured}")
    assert measured.identical >= FLOORS[mode]["identical"], str(measured)
    assert measured.first_token >= FLOORS[mode]["first_token"], str(measured)


def _linear_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (QuantizedColumnParallelLinear, QuantizedRowParallelLinear))]


@pytest.mark.parametrize(("mode", "stored_dtype", "fraction"), [("int8", torch.int8, 1 / 4), ("wf6af16", torch.uint8, 3 / 16)])
def test_quantized_weights_take_their_bytes(
    mode: str, stored_dtype: torch.dtype, fraction: float, tiny_checkpoints: dict[str, Path]
) -> None:
    path = tiny_checkpoints["qwen2"]
    full = load_model(path, "float32", torch.device("cpu")).model
    quantized = load_model(path, "float32", torch.device("cpu"), quantization_mode=mode).model
    layers = _linear_layers(quantized)
    assert len(layers) == 4 * full.spec.num_layers  # qkv, o, gate_up, down per layer
    fp32_bytes = sum(p.nbytes for n, p in full.named_parameters() if n.endswith("proj.weight"))
    weight_bytes = sum(m.weight.nbytes for m in layers)
    scale_bytes = sum(m.weight_scale.nbytes for m in layers)
    assert all(m.weight.dtype == stored_dtype for m in layers)
    assert weight_bytes == fp32_bytes * fraction
    assert scale_bytes == sum(m.weight_scale.shape[0] * 4 for m in layers)  # one float32 per output row
    # the embedding, LM head, norms and biases stay in the model dtype
    kept = {n: p for n, p in quantized.named_parameters() if not n.endswith("proj.weight")}
    assert all(p.dtype == torch.float32 for p in kept.values())
    assert kept["embed_tokens.weight"].shape == full.embed_tokens.weight.shape


@pytest.mark.parametrize("mode", ["int8", "wf6af16"])
def test_tensor_parallel_shards_weights_and_scales_together(mode: str, tiny_checkpoints: dict[str, Path]) -> None:
    """Each of 2 ranks holds exactly its slice of the one-rank quantized weights and scales: column-parallel
    layers split rows (weights and scales), row-parallel layers split columns and keep every row's scale,
    computed over the whole row."""
    path, cpu = tiny_checkpoints["qwen2"], torch.device("cpu")
    whole = _linear_layers(load_model(path, "float32", cpu, quantization_mode=mode).model)
    ranks = [_linear_layers(load_model(path, "float32", cpu, TensorParallelGroup(r, 2), mode).model) for r in (0, 1)]
    for i, one in enumerate(whole):
        shards = [r[i] for r in ranks]
        if isinstance(one, QuantizedRowParallelLinear):
            for shard in shards:
                assert torch.equal(shard.weight_scale, one.weight_scale)
            # FP6 packs each rank's columns on their own: compare the unpacked values
            values = [_values(s.weight) for s in shards]
            assert torch.equal(torch.cat(values, dim=1), _values(one.weight))
        else:  # packed outputs (q, k, v or gate, up) are split one by one
            for name in ("weight", "weight_scale"):
                sections = getattr(one, name).split([rows for rows, _, _ in one.out_shards])
                for rank, shard in enumerate(shards):
                    want = torch.cat([section.chunk(2)[rank] for section in sections])
                    assert torch.equal(getattr(shard, name), want), (i, name, rank)


def _values(weight: torch.Tensor) -> torch.Tensor:
    from mii_server.kernels.fp6_format import unpack_fp6

    return unpack_fp6(weight) if weight.dtype == torch.uint8 else weight


@pytest.mark.parametrize(("variant", "mode"), [("qwen2", "int8"), ("llama", "wf6af16")])
def test_tp2_equals_tp1(variant: str, mode: str, tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """tensor_parallel=2 (torchrun, gloo) gives the greedy tokens of one rank for a quantized model."""
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "Numbers 0 1 2 3 café 東京 🙂"]
    path = tiny_checkpoints[variant]
    out = tmp_path / "tp.json"
    base = free_port_block(2)
    env = {**os.environ, "MII_SERVER_ZMQ_PORT": str(base), "MII_SERVER_PROGRESS": "0"}
    script = Path(__file__).parents[1] / "tensor_parallel" / "tp_script.py"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(base + 1),
        str(script), str(path), str(out), json.dumps(prompts), "rank0", json.dumps({"quantization_mode": mode}),
    ]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-6000:]
    sharded = json.loads((tmp_path / "tp.json.0").read_text())
    pipe = mii_server.pipeline(str(path), quantization_mode=mode)
    first = pipe(prompts, max_new_tokens=16, do_sample=False, ignore_eos=True)
    second = pipe(prompts[:1], max_new_tokens=4, do_sample=False, ignore_eos=True)
    pipe.destroy()
    assert sharded["first"] == [r.token_ids for r in first]
    assert sharded["second"] == [r.token_ids for r in second]


def test_unknown_mode_is_refused_naming_the_accepted_ones(tiny_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(InvalidRequest, match="'fp8', 'int8' or 'wf6af16'"):
        ModelConfig.from_kwargs(str(tiny_checkpoints["llama"]), quantization_mode="int4")
    with pytest.raises(InvalidRequest, match="'fp8', 'int8' or 'wf6af16'"):
        mii_server.pipeline(str(tiny_checkpoints["llama"]), quantization_mode="awq")
    with pytest.raises(InvalidRequest, match="fp8, int8, wf6af16"):
        load_model(tiny_checkpoints["llama"], "float32", torch.device("cpu"), quantization_mode="int4")


def test_fp8_mode_needs_fp8_tensor_cores(tiny_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(UnsupportedModel, match="fp8 tensor cores"):
        mii_server.pipeline(str(tiny_checkpoints["llama"]), quantization_mode="fp8", device="cpu")
