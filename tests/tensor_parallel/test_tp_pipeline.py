"""tensor_parallel=T (gloo on the CPU, under torchrun) gives the same greedy tokens as one rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
from server.helpers import free_port_block

import mii_server
from mii_server.errors import InvalidRequest

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "Numbers 0 1 2 3 café 東京 🙂"]


def run_tp(path: Path, ranks: int, prompts: list[str], all_ranks: bool, tmp_path: Path, **config: object) -> list[Path]:
    """Run tp_script.py under torchrun; returns the result files it wrote (one per reporting rank)."""
    out = tmp_path / "tp.json"
    base = free_port_block(2)
    env = {**os.environ, "MII_SERVER_ZMQ_PORT": str(base), "MII_SERVER_PROGRESS": "0"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
        "--master-addr", "127.0.0.1", "--master-port", str(base + 1),
        str(Path(__file__).with_name("tp_script.py")), str(path), str(out), json.dumps(prompts),
        "all" if all_ranks else "rank0", json.dumps(config),
    ]  # fmt: skip
    # a hung rank dumps its stack and exits (tp_script's watchdog) well before this timeout
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-6000:]
    return sorted(tmp_path.glob("tp.json.*"))


def tp1_outputs(path: Path, prompts: list[str], **config: object) -> tuple[list[list[int]], list[list[int]]]:
    """The two generate calls of tp_script.py, on one rank."""
    pipe = mii_server.pipeline(str(path), **config)
    first = pipe(prompts, max_new_tokens=16, do_sample=False, ignore_eos=True)
    second = pipe(prompts[:1], max_new_tokens=4, do_sample=False, ignore_eos=True)
    pipe.destroy()
    return [r.token_ids for r in first], [r.token_ids for r in second]


@pytest.mark.parametrize(
    ("variant", "ranks", "all_ranks"),
    [
        ("llama", 2, False),
        ("llama3", 2, False),
        ("qwen2", 2, True),  # all_rank_output: every rank returns the responses
        ("llama", 4, False),  # 4 ranks: the 2 KV heads are replicated
        ("mixtral", 2, False),  # every expert split like an MLP, one all-reduce per MoE layer
        ("qwen2_moe", 2, False),  # the same with the shared expert, and a dense layer
    ],
)
def test_tp_equals_tp1(
    variant: str, ranks: int, all_ranks: bool, tiny_checkpoints: Mapping[str, Path], tmp_path: Path
) -> None:
    path = tiny_checkpoints[variant]
    written = run_tp(path, ranks, PROMPTS, all_ranks, tmp_path)
    assert [p.suffix for p in written] == ([f".{r}" for r in range(ranks)] if all_ranks else [".0"])
    first, second = tp1_outputs(path, PROMPTS)
    for file in written:
        sharded = json.loads(file.read_text())
        assert sharded["first"] == first
        assert sharded["second"] == second
    # overlap scheduling is on by default under TP too: every decode step after the first names the
    # previous step's tokens by placeholders, which the followers receive from rank 0 on the device;
    # a follower holding wrong ids would embed wrong tokens, and the all-reduces would change rank 0's
    assert json.loads(written[0].read_text())["overlap"] is True


def test_tp_preempting_with_overlap_equals_tp1(tiny_checkpoints: Mapping[str, Path], tmp_path: Path) -> None:
    """A cache too small for every prompt at once: requests are preempted (blocks freed, tokens
    recomputed) while steps overlap. The followers free and recompute what rank 0's Steps say."""
    path = tiny_checkpoints["llama"]
    config = {"kv_cache": {"block_size": 4, "num_blocks": 14}}
    (written,) = run_tp(path, 2, PROMPTS, False, tmp_path, **config)
    sharded = json.loads(written.read_text())
    assert sharded["overlap"] is True and sharded["preemptions"] > 0
    assert (sharded["first"], sharded["second"]) == tp1_outputs(path, PROMPTS, **config)


def test_tp_without_overlap_equals_tp1(tiny_checkpoints: Mapping[str, Path], tmp_path: Path) -> None:
    """overlap_scheduling=False: every Step carries real token ids, and no ids are broadcast."""
    path = tiny_checkpoints["llama"]
    (written,) = run_tp(path, 2, PROMPTS, False, tmp_path, overlap_scheduling=False)
    sharded = json.loads(written.read_text())
    assert sharded["overlap"] is False
    assert (sharded["first"], sharded["second"]) == tp1_outputs(path, PROMPTS)


def test_tp_prefix_caching_equals_tp1_without(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Rank 0 decides which cached blocks a request reuses and which blocks fill up; the follower
    applies the same decisions from the Steps to its own cache (every rank, its own KV heads)."""
    path = tiny_checkpoints["llama"]
    shared = "The quick brown fox jumps over the lazy dog. A model server answers requests for text. "
    prompts = [shared + tail for tail in ["Hello", "Numbers 0 1 2 3", "café 東京", "Deployments", "a", "b c"]]
    # a small token budget admits the prompts over several steps: later ones find earlier prefixes
    config = {"max_ragged_batch_size": 24, "max_ragged_sequence_count": 4, "kv_cache": {"block_size": 4, "num_blocks": 96}}
    (written,) = run_tp(path, 2, prompts, False, tmp_path, enable_prefix_caching=True, **config)
    sharded = json.loads(written.read_text())
    assert sum(sharded["cached"]) > 0
    assert (sharded["first"], sharded["second"]) == tp1_outputs(path, prompts, enable_prefix_caching=False, **config)


def test_tp_without_launcher_is_a_clear_error(tiny_checkpoints: Mapping[str, Path], monkeypatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(InvalidRequest, match="torchrun --nproc-per-node 2"):
        mii_server.pipeline(str(tiny_checkpoints["llama"]), tensor_parallel=2)
