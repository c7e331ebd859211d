"""Whole models on the Triton ops give the reference ops' greedy tokens: the MoE router, sort and
grouped GEMMs inside Mixtral, the windowed, soft-capped attention and GeGLU inside Gemma 2.

On the CPU the Triton ops run in the interpreter (``TRITON_INTERPRET=1``, set by conftest.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

import mii_server

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog."]


@pytest.mark.parametrize("variant", ["mixtral", "gemma2"])
def test_triton_ops_generate_what_the_reference_generates(
    variant: str, tiny_checkpoints: Mapping[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs = {}
    for kernels in ("reference", "triton"):
        monkeypatch.setenv("MII_SERVER_KERNELS", kernels)
        # float32 on the CPU too, so both runs compare like with like; a small token budget splits prompts
        pipe = mii_server.pipeline(
            str(tiny_checkpoints[variant]), dtype="float32", max_ragged_batch_size=16, max_ragged_sequence_count=3
        )
        responses = pipe(PROMPTS, max_new_tokens=4, do_sample=False, ignore_eos=True)
        outputs[kernels] = [r.token_ids for r in responses]
        pipe.destroy()
    assert outputs["triton"] == outputs["reference"]
