"""Prompt attention by FlashAttention-4 on Hopper, where the optional ``flash-attn-4`` package is installed.

FlashAttention-4's CuTe kernels (``flash_attn.cute``, Dao-AILab) overlap the softmax with the tensor
cores by warp specialisation, which Triton 3.6 cannot express on Hopper. They read K/V straight from
the paged cache: its [blocks, block_size, kv_heads, D] layout is their page layout, the block table
their page table, the contexts their ``seqused_k``. ``triton_attention`` sends a batch's prompt rows
here when ``usable`` says so; everything else (decode, other GPUs, sliding windows, soft-capped
logits, fp16 models, an fp8 cache) stays with the Triton kernels, which CI runs in Triton's
interpreter.

why: measured on an H200 (docs/BENCHMARKS.md, "Prefill attention by FlashAttention-4"), 8 x 2,048
fresh tokens ran at 61-62% of bf16 peak here against 49-50% for the Triton kernel, and ragged or
prefix-cached prompt batches 1.35x faster.

``MII_SERVER_PREFILL_ATTENTION``: ``auto`` (default) uses FlashAttention-4 where it is installed and
usable; ``triton`` never does; ``flash_attn_4`` makes a missing package or a refused batch an error
instead of a silent fallback. The package is pinned (the ``fa4`` extra): the key tile is set through its internal forward
entry point, the public one has no such argument.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType

import torch

from .metadata import AttentionMetadata

_log = logging.getLogger(__name__)
# what the library said of the batch it refused (text only: an exception's traceback would keep that
# batch's tensors alive); once it holds one, auto mode stops using it
_refused: list[str] = []
_announced: list[bool] = []  # the first batch it served was logged

PREFILL_ATTENTION_ENV = "MII_SERVER_PREFILL_ATTENTION"
CHOICES = ("auto", "triton", "flash_attn_4")
# the cache block sizes measured; a block of 64 keys is one TMA copy only with 64-key tiles
BLOCK_SIZES = (64, 128)
# prompt tokens below which a batch stays with Triton: a call costs ~0.1 ms of host time (measured), more
# than Triton's kernel takes on so few rows
MIN_PROMPT_TOKENS = 1024


def choice() -> str:
    value = os.environ.get(PREFILL_ATTENTION_ENV, "auto").lower()
    if value not in CHOICES:
        raise ValueError(f"{PREFILL_ATTENTION_ENV} must be one of {', '.join(CHOICES)}, not {value!r}")
    return value


@functools.lru_cache(maxsize=1)
def _load(required: bool) -> ModuleType | None:
    # compiled kernels kept on disk, so a restart does not compile them again (as Triton's cache does)
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    try:
        from flash_attn.cute import interface
    except ImportError as exc:
        if required:
            raise ImportError(
                f"{PREFILL_ATTENTION_ENV}=flash_attn_4 needs the flash-attn-4 package: "
                "pip install 'mii-server[fa4]'"
            ) from exc
        return None
    return interface


def library() -> ModuleType | None:
    """``flash_attn.cute.interface`` when it is importable and not turned off (nor refused a batch
    in this process), else None."""
    wanted = choice()
    if wanted == "triton" or (_refused and wanted == "auto"):
        return None
    return _load(wanted == "flash_attn_4")


@functools.lru_cache(maxsize=8)
def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def usable(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prompt_tokens: int, *,
    sliding_window: int = 0, logit_softcap: float = 0.0,
) -> bool:  # fmt: skip
    """Whether ``prompt_tokens`` rows of q go to FlashAttention-4: a Hopper GPU (the only one measured),
    bf16 q and cache, a measured block size, a head size it takes, full causal attention, enough rows
    to pay for its host time, and the package importable.

    why bf16 only: its TMA tiles read a sequence's last block whole, rows past the context included,
    and mask their scores; a stale inf or NaN there (left by an earlier sequence) still turns P = 0
    times V into NaN. fp16 activations overflow to inf in practice, bf16's do not; the Triton kernel
    masks the loads themselves, so fp16 models stay with it.
    """
    head_dim = q.shape[-1]
    return (
        q.is_cuda
        and prompt_tokens >= MIN_PROMPT_TOKENS
        and q.dtype == torch.bfloat16
        and k_cache.dtype == q.dtype
        and v_cache.dtype == q.dtype
        and k_cache.shape[1] in BLOCK_SIZES
        and head_dim % 8 == 0
        and 8 <= head_dim <= 256
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and not sliding_window
        and not logit_softcap
        and _is_hopper(q.device)
        and not torch.cuda.is_current_stream_capturing()  # CUDA graphs hold decode-sized batches only
        and library() is not None
    )


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """Causal attention of every sequence of ``meta`` (q holds all their new tokens) over the paged
    cache, into ``out`` (a new tensor when None); the contract of ``reference.paged_attention``.

    None when the library refused the batch before launching anything (it checks its inputs and
    compiles a kernel per configuration on first use): the caller runs its own kernel instead, and,
    unless ``flash_attn_4`` was asked for (then the error is raised), this process uses
    FlashAttention-4 no more, after one warning.
    """
    fa4 = library()
    assert fa4 is not None, "FlashAttention-4 is not available; check usable() first"
    block_size = k_cache.shape[1]
    # 128 x 128 tiles are its own choice at D = 128; 64-key tiles keep a 64-slot block one TMA copy
    tiles = (128, block_size) if block_size < 128 else None
    try:
        result = fa4._flash_attn_fwd(
            q, k_cache, v_cache, cu_seqlens_q=meta.cu_q_lens, seqused_k=meta.context_lens,
            max_seqlen_q=meta.max_q_len, max_seqlen_k=meta.max_context_len, page_table=meta.block_table,
            softmax_scale=scale, causal=True, tile_mn=tiles, out=out,
        )  # fmt: skip
    except Exception as exc:  # whatever it refuses, the Triton kernel serves
        if choice() == "flash_attn_4":
            raise
        _refused.append(f"{type(exc).__name__}: {exc}")
        _log.warning(
            "FlashAttention-4 refused a prompt batch (%s); prompt attention stays with the Triton kernel in "
            "this process (%s=triton silences this)", _refused[-1], PREFILL_ATTENTION_ENV,
        )  # fmt: skip
        return None
    if not _announced:
        _announced.append(True)
        _log.info(
            "prompt attention by FlashAttention-4 (flash-attn-4 %s) for batches of %d+ prompt tokens; %s=triton "
            "turns it off", _version(), MIN_PROMPT_TOKENS, PREFILL_ATTENTION_ENV,
        )  # fmt: skip
    return result[0]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flash-attn-4")
    except PackageNotFoundError:  # importable without its metadata (a checkout on the path)
        return "unknown version"
