"""``kv_cache={"dtype": "fp8"}``: keys and values cached as float8 e4m3 (no scales), read back into the
model dtype by attention.

Measured greedy agreement with the model-dtype cache (fp32 tiny models, 16 prompts x 16 tokens):
llama 10/16 identical, 16/16 first token, 219/256 positions; llama3 9/16, 16/16, 220/256;
mistral 8/16, 15/16, 210/256; qwen2 13/16, 15/16, 250/256.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mii_server
from mii_server.errors import InvalidRequest

from .agreement import agreement, greedy


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
def test_fp8_cache_greedy_agreement(variant: str, tiny_checkpoints: dict[str, Path]) -> None:
    path = str(tiny_checkpoints[variant])
    measured = agreement(greedy(path), greedy(path, kv_cache={"dtype": "fp8"}))
    print(f"{variant} kv fp8: {measured}")
    assert measured.first_token >= 15 and measured.identical >= 8, str(measured)


def test_fp8_cache_holds_its_bytes_worth_of_blocks(tiny_checkpoints: dict[str, Path]) -> None:
    """The same byte budget holds 4x the float32 blocks (1 byte an element instead of 4)."""
    blocks = {}
    for dtype in ("auto", "fp8"):
        pipe = mii_server.pipeline(str(tiny_checkpoints["llama"]), kv_cache={"dtype": dtype, "memory_bytes": 1 << 20})
        engine = pipe.runtime.engine
        blocks[dtype] = engine.total_blocks
        assert engine.kv_cache.keys[0].dtype == (torch.float8_e4m3fn if dtype == "fp8" else torch.float32)
        pipe.destroy()
    assert blocks["fp8"] == 4 * blocks["auto"]


def test_unknown_cache_dtype_is_refused(tiny_checkpoints: dict[str, Path]) -> None:
    with pytest.raises(InvalidRequest, match="'auto' or 'fp8'"):
        mii_server.pipeline(str(tiny_checkpoints["llama"]), kv_cache={"dtype": "int8"})
