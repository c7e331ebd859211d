"""init_inference on CUDA (skipped without it): injected Triton kernels and decode CUDA graphs give
transformers' tokens; with two GPUs, the graphs capture NCCL all-reduces under tensor parallelism.

Against transformers the fp32 tokens are compared by agreement: cuBLAS sums in another order for a
flat ragged batch than for a padded one, so a near-tie of a tiny random model can part the greedy
paths (the CPU tests compare exactly). The same kernels with graphs on and off must agree exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from inference.helpers import PROMPTS, generate_kwargs, padded_batch, token_agreement
from transformers import AutoModelForCausalLM

import mii_server
from mii_server.inference.cuda_graph import DecodeGraphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with head size 64 (the Triton kernels' tiles need head sizes of at least 16)."""
    from mii_server.demo_model import build_tiny_checkpoint

    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("gpu-init-inference") / "llama", "llama", seed=5, hidden_size=256,
        intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
    )  # fmt: skip


def load(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to("cuda").eval()


def test_graphs_match_transformers_in_fp32(checkpoint: Path) -> None:
    plain = load(checkpoint, torch.float32)
    engine = mii_server.init_inference(load(checkpoint, torch.float32), replace_with_kernel_inject=True,
                                       enable_cuda_graph=True)  # fmt: skip
    graphs = engine.injected.graphs
    assert isinstance(graphs, DecodeGraphs)
    eager = mii_server.init_inference(load(checkpoint, torch.float32), replace_with_kernel_inject=True)
    for prompts in (PROMPTS, PROMPTS[1:2], PROMPTS):  # batch 4 (padded), batch 1, batch 4 again (replayed)
        batch = {k: v.cuda() for k, v in padded_batch(checkpoint, prompts).items()}
        got = engine.generate(**batch, **generate_kwargs())
        assert token_agreement(got, plain.generate(**batch, **generate_kwargs())) >= 0.95
        assert torch.equal(got, eager.generate(**batch, **generate_kwargs()))
    assert graphs.batch_sizes == [1, 4]


def test_graphs_replay_the_eager_step_in_bf16(checkpoint: Path) -> None:
    eager = mii_server.init_inference(load(checkpoint, torch.bfloat16), replace_with_kernel_inject=True)
    graphed = mii_server.init_inference(load(checkpoint, torch.bfloat16), replace_with_kernel_inject=True,
                                        enable_cuda_graph=True)  # fmt: skip
    batch = {k: v.cuda() for k, v in padded_batch(checkpoint).items()}
    assert torch.equal(
        graphed.generate(**batch, **generate_kwargs()), eager.generate(**batch, **generate_kwargs())
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_with_graphs_over_nccl(checkpoint: Path, tmp_path: Path) -> None:
    batch = padded_batch(checkpoint)
    case = {"path": str(checkpoint), "batch": {k: v.tolist() for k, v in batch.items()},
            "generate": generate_kwargs(),
            "config": {"replace_with_kernel_inject": True, "enable_cuda_graph": True}}  # fmt: skip
    out = tmp_path / "tp.json"
    script = Path(__file__).resolve().parents[1] / "inference" / "tp_inference_script.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29561",
           str(script), json.dumps({"llama-graphs": case}), str(out)]  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        cmd, env=dict(os.environ), cwd=root, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-6000:]
    plain = load(checkpoint, torch.float32)
    want = plain.generate(**{k: v.cuda() for k, v in batch.items()}, **generate_kwargs())
    assert token_agreement(torch.tensor(json.loads(out.read_text())["llama-graphs"]), want.cpu()) >= 0.95
