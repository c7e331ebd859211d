"""init_inference with tensor_parallel={"tp_size": 2} under torchrun (gloo on the CPU) equals one rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from server.helpers import free_port_block
from transformers import AutoModelForCausalLM

from .helpers import generate_kwargs, padded_batch, save_foreign

RANKS = 2
INJECTED = ("llama", "mistral", "qwen2")
OPT_POLICY = {"OPTDecoderLayer": ["self_attn.out_proj", "fc2"]}  # the script passes the class itself


def test_tp2_equals_transformers(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    foreign = save_foreign(tmp_path)
    batch = padded_batch(tiny_checkpoints["llama"])  # one tokenizer for all: the same 384-word vocabulary
    cases = {
        # kernel injection: our layers, built sharded (2 KV heads, one per rank; qwen2's 4, two each)
        **{
            v: {"path": tiny_checkpoints[v], "config": {"replace_with_kernel_inject": True}} for v in INJECTED
        },
        # automatic tensor parallelism of transformers' own layers (mp_size: DeepSpeed's old key)
        "llama-autotp": {"path": tiny_checkpoints["llama"], "config": {"mp_size": RANKS}},
        "gpt2-autotp": {"path": foreign["gpt2"], "config": {}},  # Conv1D, packed q/k/v, split_size
        "opt-policy": {"path": foreign["opt"], "config": {"injection_policy": OPT_POLICY}},
    }
    for case in cases.values():
        case["path"] = str(case["path"])
        case["batch"] = {k: v.tolist() for k, v in batch.items()}
        case["generate"] = generate_kwargs()
    out = tmp_path / "tp.json"
    base = free_port_block(1)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
        "--master-addr", "127.0.0.1", "--master-port", str(base),
        str(Path(__file__).with_name("tp_inference_script.py")), json.dumps(cases), str(out),
    ]  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        cmd, env=dict(os.environ), cwd=root, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-6000:]
    sharded = json.loads(out.read_text())
    for name, case in cases.items():
        plain = AutoModelForCausalLM.from_pretrained(case["path"], dtype=torch.float32).eval()
        want = plain.generate(**batch, **generate_kwargs())
        assert sharded[name] == want.tolist(), name
        with torch.no_grad():
            logits = plain(**batch).logits[batch["attention_mask"].bool()]
        assert (torch.tensor(sharded[name + ":logits"]) - logits).abs().max().item() < 1e-4, name
