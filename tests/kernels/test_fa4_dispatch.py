"""When prompt attention goes to FlashAttention-4: the switch, its errors, and the cases it declines."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mii_server.kernels import fa4_attention

INSTALLED = importlib.util.find_spec("flash_attn") is not None


@pytest.fixture(autouse=True)
def _fresh_load():
    fa4_attention._load.cache_clear()
    yield
    fa4_attention._load.cache_clear()


def test_an_unknown_choice_names_the_accepted_ones(monkeypatch) -> None:
    monkeypatch.setenv(fa4_attention.PREFILL_ATTENTION_ENV, "cudnn")
    with pytest.raises(ValueError, match="auto, triton, flash_attn_4"):
        fa4_attention.library()


def test_triton_turns_it_off(monkeypatch) -> None:
    monkeypatch.setenv(fa4_attention.PREFILL_ATTENTION_ENV, "triton")
    assert fa4_attention.library() is None


@pytest.mark.skipif(INSTALLED, reason="flash-attn-4 is installed here")
def test_a_missing_package_is_silent_in_auto_and_an_error_when_asked_for(monkeypatch) -> None:
    monkeypatch.setenv(fa4_attention.PREFILL_ATTENTION_ENV, "auto")
    assert fa4_attention.library() is None
    monkeypatch.setenv(fa4_attention.PREFILL_ATTENTION_ENV, "flash_attn_4")
    with pytest.raises(ImportError, match=r"mii-server\[fa4\]"):
        fa4_attention.library()


def _inputs(device: str, dtype=torch.bfloat16, cache_dtype=None, block_size: int = 64, head_dim: int = 128):
    q = torch.zeros(4, 8, head_dim, dtype=dtype, device=device)
    cache = torch.zeros(4, block_size, 2, head_dim, dtype=cache_dtype or dtype, device=device)
    return q, cache, cache.clone()


def test_cpu_tensors_stay_with_the_other_kernels() -> None:
    assert not fa4_attention.usable(*_inputs("cpu"), 4096)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "inputs, prompt_tokens, options",
    [
        ({}, fa4_attention.MIN_PROMPT_TOKENS - 1, {}),  # too few rows to pay for its host time
        ({"cache_dtype": torch.float8_e4m3fn}, 4096, {}),  # an fp8 cache
        ({"dtype": torch.float32}, 4096, {}),
        ({"block_size": 16}, 4096, {}),  # a block size not measured
        ({"head_dim": 100}, 4096, {}),
        ({}, 4096, {"sliding_window": 512}),
        ({}, 4096, {"logit_softcap": 30.0}),
    ],
)
def test_what_it_declines(inputs, prompt_tokens, options) -> None:
    assert not fa4_attention.usable(*_inputs("cuda", **inputs), prompt_tokens, **options)
