"""init_inference on the CPU: injected kernels equal transformers token for token; config handling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import mii_server
from mii_server.errors import CapacityExceeded, InvalidRequest, UnknownArgument, UnsupportedModel
from mii_server.inference import InferenceConfig
from mii_server.inference.decoder import CACHE_FIELD, InjectedDecoder
from mii_server.models.parallel import TensorParallelGroup

from .helpers import PROMPTS, build_foreign, generate_kwargs, padded_batch

FAMILIES = ["llama", "llama3", "mistral", "qwen2"]


def load(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", FAMILIES)
def test_injected_generate_and_logits_match_transformers(
    variant: str, tiny_checkpoints: dict[str, Path]
) -> None:
    path = tiny_checkpoints[variant]
    plain = load(path)
    engine = mii_server.init_inference(load(path), dtype=torch.float32, replace_with_kernel_inject=True)
    assert isinstance(engine.module.model, InjectedDecoder) and engine.injected is engine.module.model
    batch = padded_batch(path)  # 4 prompts, left-padded to the longest
    assert (batch["attention_mask"] == 0).any()
    expected = plain.generate(**batch, **generate_kwargs())
    assert torch.equal(engine.generate(**batch, **generate_kwargs()), expected)
    one = padded_batch(path, PROMPTS[1:2])  # batch 1, no padding (a smaller batch in the same pool)
    assert torch.equal(
        engine.generate(**one, **generate_kwargs()), plain.generate(**one, **generate_kwargs())
    )

    with torch.no_grad():
        want = plain(**batch).logits
    got = engine(**batch).logits
    real = batch["attention_mask"].bool()  # padding positions carry no meaning in either model
    assert got.shape == want.shape
    assert (got[real] - want[real]).abs().max().item() < 1e-4


def test_generate_arguments_and_cache_use(tiny_checkpoints: dict[str, Path]) -> None:
    """Sampling, beam search, several return sequences, embeddings as input, no cache; a returned
    cache continues; a superseded one is refused."""
    path = tiny_checkpoints["llama"]
    plain = load(path)
    engine = mii_server.init_inference(load(path), replace_with_kernel_inject=True)
    batch = padded_batch(path, PROMPTS[:2])
    for kwargs in (
        {"do_sample": True, "top_k": 20, "num_return_sequences": 2},
        {"num_beams": 3, "num_return_sequences": 2},  # reorders the cache's rows every step
    ):
        torch.manual_seed(0)
        want = plain.generate(**batch, max_new_tokens=10, pad_token_id=3, **kwargs)
        torch.manual_seed(0)
        assert torch.equal(engine.generate(**batch, max_new_tokens=10, pad_token_id=3, **kwargs), want)

    ids, mask = batch["input_ids"], batch["attention_mask"]
    embeds = plain.get_input_embeddings()(ids).detach()
    for kwargs in ({"inputs_embeds": embeds, "attention_mask": mask}, {**batch, "use_cache": False}):
        want = plain.generate(**kwargs, max_new_tokens=8, do_sample=False, pad_token_id=3)
        assert torch.equal(engine.generate(**kwargs, max_new_tokens=8, do_sample=False, pad_token_id=3), want)

    with torch.no_grad():
        want = plain(ids, attention_mask=mask).logits
    first = engine(ids[:, :4], attention_mask=mask[:, :4], use_cache=True)
    cache = getattr(first, CACHE_FIELD)
    assert cache.get_seq_length() == 4
    rest = engine(ids[:, 4:], attention_mask=mask, **{CACHE_FIELD: cache})
    got = torch.cat([first.logits, rest.logits], dim=1)
    assert (got - want)[mask.bool()].abs().max().item() < 1e-4
    uncached = engine(ids, attention_mask=mask, use_cache=False)
    assert getattr(uncached, CACHE_FIELD) is None
    assert (uncached.logits - want)[mask.bool()].abs().max().item() < 1e-4
    engine.generate(**batch, max_new_tokens=2)  # a new generation retires the earlier cache
    with pytest.raises(InvalidRequest, match="superseded"):
        engine(ids[:, :1], **{CACHE_FIELD: cache})


def test_max_out_tokens_bounds_the_cache(tiny_checkpoints: dict[str, Path]) -> None:
    path = tiny_checkpoints["qwen2"]
    batch = padded_batch(path, PROMPTS[1:2])
    prompt = batch["input_ids"].shape[1]
    engine = mii_server.init_inference(load(path), replace_with_kernel_inject=True, max_out_tokens=prompt + 4)
    assert (
        engine.generate(**batch, **{**generate_kwargs(), "max_new_tokens": 4, "min_new_tokens": 4}).shape[1]
        == prompt + 4
    )
    with pytest.raises(CapacityExceeded, match="max_out_tokens"):
        engine.generate(**batch, **generate_kwargs())


def test_config_sources_and_precedence(tmp_path: Path) -> None:
    file = tmp_path / "ds_config.json"
    file.write_text(json.dumps({"dtype": "fp16", "tensor_parallel": {"tp_size": 1}, "max_out_tokens": 8}))
    from_file = InferenceConfig.resolve(str(file), {})
    assert from_file.dtype == torch.float16 and from_file.max_out_tokens == 8
    merged = InferenceConfig.resolve(file, {"max_out_tokens": 64, "dtype": torch.bfloat16})  # kwargs win
    assert merged.dtype == torch.bfloat16 and merged.max_out_tokens == 64
    from_dict = InferenceConfig.resolve(
        {"replace_with_kernel_inject": True, "mp_size": 1}, {"enable_cuda_graph": False}
    )
    assert from_dict.replace_with_kernel_inject and from_dict.tp_size == 1 and not from_dict.enable_cuda_graph
    assert InferenceConfig.resolve({"mp_size": 4}, {}).tensor_parallel.tp_size == 4  # the old name
    assert InferenceConfig.resolve({}, {"tensor_parallel": 2}).tp_size == 2
    assert InferenceConfig.resolve({"max_tokens": 99}, {}).max_out_tokens == 99
    assert InferenceConfig.resolve(None, {"dtype": "bf16"}).dtype == torch.bfloat16
    policy = InferenceConfig.resolve({"injection_policy": {"OPTDecoderLayer": "fc2"}}, {}).injection_policy
    assert policy == {"OPTDecoderLayer": ("fc2",)}

    with pytest.raises(UnknownArgument, match="replace_with_kernels, tp_szie"):
        InferenceConfig.resolve({"tp_szie": 2}, {"replace_with_kernels": True})
    with pytest.raises(UnknownArgument, match="checkpoint: DeepSpeed options"):
        InferenceConfig.resolve({}, {"checkpoint": "x.json"})
    with pytest.raises(UnknownArgument, match="tp_szie"):
        mii_server.init_inference(torch.nn.Linear(2, 2), {"tensor_parallel": {"tp_size": 1}}, tp_szie=2)
    for bad in ({"dtype": "fp8"}, {"mp_size": 2, "tensor_parallel": {"tp_size": 4}}, {"max_out_tokens": 0},
                {"tensor_parallel": {"tp_size": 1, "mpu": None}}, {"injection_policy": {"X": []}}):  # fmt: skip
        with pytest.raises(InvalidRequest):
            InferenceConfig.resolve(bad, {})
    with pytest.raises(InvalidRequest, match="cannot read"):
        InferenceConfig.resolve(tmp_path / "missing.json", {})


def test_requests_that_cannot_be_served(
    tiny_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_checkpoints["llama"]
    with pytest.raises(InvalidRequest, match="int8.*replace_with_kernel_inject=True"):
        mii_server.init_inference(load(path), dtype="int8")  # int8 quantizes the injected layers only
    with pytest.raises(InvalidRequest, match="CUDA"):
        mii_server.init_inference(load(path), replace_with_kernel_inject=True, enable_cuda_graph=True)
    with pytest.raises(UnsupportedModel, match="replace_with_kernel_inject=False"):
        mii_server.init_inference(build_foreign("gpt2"), replace_with_kernel_inject=True)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(InvalidRequest, match="torchrun --nproc-per-node 2"):
        mii_server.init_inference(load(path), tensor_parallel={"tp_size": 2})


@pytest.mark.parametrize("kind", ["gpt2", "opt"])
def test_family_without_kernels_is_wrapped(kind: str) -> None:
    """dtype conversion and wrapping of a model we have no kernels for: generate is transformers' own."""
    plain = build_foreign(kind).to(torch.bfloat16)
    engine = mii_server.init_inference(build_foreign(kind), dtype="bf16")
    assert engine.module.dtype == torch.bfloat16
    ids = torch.tensor([[5, 6, 7, 8, 9], [3, 3, 11, 12, 13]])
    mask = (ids != 3).long()
    want = plain.generate(ids, attention_mask=mask, **generate_kwargs())
    assert torch.equal(engine.generate(ids, attention_mask=mask, **generate_kwargs()), want)


def test_automatic_sharding_plan_and_its_errors() -> None:
    """The column/row plan of known layers, and what an unknown layer or a wrong policy is told
    (the sharded forwards themselves run under torchrun in test_init_inference_tp.py)."""
    from mii_server.inference.tensor_parallel import classify, decoder_layers, shard_model

    gpt2 = build_foreign("gpt2")
    layers = decoder_layers(gpt2, None)
    assert len(layers) == 2 and all(rows is None for _, rows in layers)
    assert classify(layers[0][0], None) == {"attn.c_attn": "column", "attn.c_proj": "row", "mlp.c_fc": "column",
                                            "mlp.c_proj": "row"}  # fmt: skip
    opt = build_foreign("opt")
    layer = opt.model.decoder.layers[0]
    plan = classify(layer, ("self_attn.out_proj", "fc2"))
    assert [n for n, kind in plan.items() if kind == "row"] == ["self_attn.out_proj", "fc2"]
    with pytest.raises(InvalidRequest, match="fc3"):
        classify(layer, ("fc3",))
    with pytest.raises(InvalidRequest, match="no module of that class"):
        decoder_layers(opt, {"NoSuchLayer": ("fc2",)})
    layer.self_attn.mystery = torch.nn.Linear(4, 4)
    with pytest.raises(UnsupportedModel, match="self_attn.mystery; pass injection_policy"):
        shard_model(opt, TensorParallelGroup(rank=0, size=2), None)


def test_meta_device_model_is_materialised(tiny_checkpoints: dict[str, Path]) -> None:
    from transformers import AutoConfig

    path = tiny_checkpoints["llama"]
    plain = load(path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(str(path)), dtype=torch.float32
        )
    with pytest.raises(InvalidRequest, match="meta-device"):
        mii_server.init_inference(skeleton, replace_with_kernel_inject=True)
    engine = mii_server.init_inference(skeleton, keep_module_on_host=True)
    assert all(p.device.type == "cpu" for p in engine.module.parameters())
    engine.module.load_state_dict(plain.state_dict())
    batch = padded_batch(path)
    assert torch.equal(
        engine.generate(**batch, **generate_kwargs()), plain.generate(**batch, **generate_kwargs())
    )


def test_triton_kernels_through_the_interpreter(tiny_checkpoints: dict[str, Path]) -> None:
    """The injected decoder on the Triton twins (CPU interpreter): the GPU path's metadata, with the
    decode attention split for the whole pool, still equals transformers."""
    script = f"""
import torch
from transformers import AutoModelForCausalLM
import mii_server
from mii_server.kernels import reference
from tests.inference.helpers import PROMPTS, padded_batch
path = {str(tiny_checkpoints["llama3"])!r}
plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
engine = mii_server.init_inference(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                   replace_with_kernel_inject=True, max_out_tokens=256)
assert engine.injected.layers[0].self_attn.ops is not reference
batch = padded_batch(path, PROMPTS[:2])
kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=3)
assert torch.equal(engine.generate(**batch, **kw), plain.generate(**batch, **kw))
"""
    env = {**os.environ, "TRITON_INTERPRET": "1", "MII_SERVER_KERNELS": "triton"}
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]


def test_int8_weights_in_the_injected_layers(tiny_checkpoints: dict[str, Path]) -> None:
    """dtype=int8: weight-only int8 linears (a quarter of fp32's bytes) and activations in the model's
    dtype; greedy tokens stay close to the unquantized model's (random weights: a lower bound)."""
    from mii_server.quantization import QuantizedColumnParallelLinear, QuantizedRowParallelLinear

    path = tiny_checkpoints["qwen2"]
    plain = load(path)
    engine = mii_server.init_inference(load(path), dtype="int8", replace_with_kernel_inject=True)
    linears = [m for m in engine.module.modules() if isinstance(m, (QuantizedColumnParallelLinear, QuantizedRowParallelLinear))]
    assert len(linears) == 4 * plain.config.num_hidden_layers
    assert all(m.weight.dtype == torch.int8 for m in linears)
    assert engine.module.lm_head.weight.dtype == torch.float32  # the head keeps the model's dtype
    batch = padded_batch(path)
    expected = plain.generate(**batch, **generate_kwargs())
    got = engine.generate(**batch, **generate_kwargs())
    assert got.shape == expected.shape
    new = expected.shape[1] - batch["input_ids"].shape[1]
    agree = (got[:, -new:] == expected[:, -new:]).float().mean().item()
    assert agree >= 0.6, agree
