"""Tensor parallelism on CUDA (skipped without a GPU): NCCL collectives replay inside CUDA graphs, and
(with two GPUs) a TP=2 engine captures its decode graphs on every rank, overlaps its steps, and
generates what one rank generates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from server.helpers import free_port_block
from tensor_parallel.test_tp_pipeline import PROMPTS, run_tp, tp1_outputs
from test_engine_cuda import agreement

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_nccl_collectives_replay_inside_a_cuda_graph() -> None:
    """What a tensor-parallel decode graph relies on, on as many GPUs as there are (up to two): one
    GPU still runs NCCL's kernels and torch's capture path (its watchdog thread, the thread-local
    capture mode), two check the sums and rank 0's ids crossing GPUs."""
    ranks = min(2, torch.cuda.device_count())
    port = free_port_block(1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           str(Path(__file__).with_name("nccl_graph_script.py"))]  # fmt: skip
    run = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-6000:]
    assert run.stdout.count(": ok") == ranks


def test_engine_graphs_hold_nccl_collectives_and_replay_the_eager_tokens(checkpoint: Path, tmp_path: Path) -> None:
    """On one GPU: the engine's own decode graphs captured with its collectives on NCCL (forced through
    NCCL on a one-rank group, as a TP rank runs them), replayed, generate the eager forward's tokens."""
    out = tmp_path / "result.json"
    port = free_port_block(1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           str(Path(__file__).with_name("nccl_engine_graph_script.py")), str(checkpoint), str(out)]  # fmt: skip
    run = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["graphs"] == [1, 2, 4, 8]
    assert result["collectives_at_load"] > 0
    assert result["with_graphs"] == result["eager"]  # float32: the same kernels, replayed or not


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_captures_graphs_on_every_rank_and_generates_what_one_rank_does(checkpoint: Path, tmp_path: Path) -> None:
    config = {"device": "cuda", "dtype": "float32", "max_ragged_sequence_count": 8,
              "kv_cache": {"num_blocks": 64, "block_size": 16}}  # fmt: skip
    written = run_tp(checkpoint, 2, PROMPTS, True, tmp_path, **config)
    results = [json.loads(file.read_text()) for file in written]
    assert [r["graphs"] for r in results] == [True, True]
    assert results[0]["overlap"] is True
    first, second = tp1_outputs(checkpoint, PROMPTS, **config)
    for result in results:
        # the all-reduces sum in another order than one rank's products: fp32 rounding may part a path
        assert agreement(result["first"], first) >= 0.95
        assert agreement(result["second"], second) >= 0.95
