"""Fixtures of the engine tests: the transformers twin of the tiny llama checkpoint (the oracle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def hf_llama(tiny_checkpoints: dict[str, Path]) -> tuple[Any, Any]:
    """(tokenizer, float32 model in eval mode) of the tiny llama checkpoint, loaded by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tiny_checkpoints["llama"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(path), model
