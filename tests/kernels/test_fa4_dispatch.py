"""When prompt attention goes to FlashAttention-4: the switch, its errors, and the cases it declines."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mii_server.kernels import fa4_attention
from mii_server.kernels.metadata import AttentionMetadata

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
        ({"dtype": torch.float16}, 4096, {}),  # stale inf in a block's unused rows would reach P @ V
        ({"block_size": 16}, 4096, {}),  # a block size not measured
        ({"head_dim": 100}, 4096, {}),
        ({}, 4096, {"sliding_window": 512}),
        ({}, 4096, {"logit_softcap": 30.0}),
    ],
)
def test_what_it_declines(inputs, prompt_tokens, options) -> None:
    assert not fa4_attention.usable(*_inputs("cuda", **inputs), prompt_tokens, **options)


class _RefusingLibrary:
    """Stands in for flash_attn.cute.interface, which cannot run on a CPU: it refuses every batch, as
    the library's input checks and compiler do (by assertions) for a configuration they do not take."""

    @staticmethod
    def _flash_attn_fwd(*args, **kwargs):
        raise AssertionError("paged KV not supported on this configuration")


class _ServingLibrary:
    """Stands in for flash_attn.cute.interface on a CPU: it serves every batch (with zeros)."""

    @staticmethod
    def _flash_attn_fwd(q, *args, out=None, **kwargs):
        return (torch.zeros_like(q) if out is None else out.zero_()), None


def _one_prompt(q: torch.Tensor, cache: torch.Tensor) -> AttentionMetadata:
    n = q.shape[0]
    return AttentionMetadata(
        positions=torch.arange(n), slot_mapping=torch.arange(n), cu_q_lens=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32), block_table=torch.zeros(1, 1, dtype=torch.int32),
        last_token_indices=torch.tensor([n - 1]), max_q_len=n, max_context_len=n,
    )  # fmt: skip


@pytest.fixture
def refusing(monkeypatch):
    monkeypatch.setattr(fa4_attention, "_load", lambda required: _RefusingLibrary)
    monkeypatch.setattr(fa4_attention, "_refused", [])
    q, k_cache, v_cache = _inputs("cpu")
    return q, k_cache, v_cache, _one_prompt(q, k_cache)


def test_a_refused_batch_goes_back_to_triton_for_good(refusing, monkeypatch, caplog) -> None:
    monkeypatch.setenv(fa4_attention.PREFILL_ATTENTION_ENV, "auto")
    assert fa4_attention.library() is _RefusingLibrary
    with caplog.at_level("WARNING"):
        assert fa4_attention.paged_prefill_attention(*refusing, 0.1) is None
    assert "FlashAttention-4 refused a prompt batch (AssertionError" in caplog.text
    assert fa4_attention.library() is None  # no further batch is offered to it


def test_a_refusal_is_raised_when_flash_attention_4_was_asked_for(refusing, monkeypatch) -> None:
    monkeypatch.setenv(fa4_attention.PREFILL_ATTENTION_ENV, "flash_attn_4")
    with pytest.raises(AssertionError, match="paged KV not supported"):
        fa4_attention.paged_prefill_attention(*refusing, 0.1)
    assert fa4_attention.library() is _RefusingLibrary


def test_the_first_batch_it_serves_is_logged_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(fa4_attention, "_load", lambda required: _ServingLibrary)
    monkeypatch.setattr(fa4_attention, "_announced", [])
    monkeypatch.setenv(fa4_attention.PREFILL_ATTENTION_ENV, "auto")
    q, k_cache, v_cache = _inputs("cpu")
    with caplog.at_level("INFO"):
        for _ in range(2):
            out = fa4_attention.paged_prefill_attention(q, k_cache, v_cache, _one_prompt(q, k_cache), 0.1)
            assert out is not None and out.shape == q.shape
    assert caplog.text.count("prompt attention by FlashAttention-4 (flash-attn-4 ") == 1
