"""An attention layer goes from its normed rows to attention's q in one op
(``ops.linear_rotary_kv_append``) where its q/k/v is a plain product and rotary follows it directly,
and changes no output.

On the CPU the fused op is by definition the product, then ``rotary_kv_append``; the Triton kernel is
checked against that composition in ``tests/kernels/test_triton_quant.py``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mii_server.kernels import AttentionMetadata
from mii_server.models import load_model
from mii_server.models.llama import LlamaAttention

CPU = torch.device("cpu")


def _first_attention(path: Path, **kwargs) -> tuple[LlamaAttention, torch.Tensor, int]:
    model = load_model(path, "float32", CPU, **kwargs).model
    attention = next(m for m in model.modules() if isinstance(m, LlamaAttention))
    return attention, model.cos_sin, model.spec.hidden_size


def _prefill(tokens: int) -> AttentionMetadata:
    positions = torch.arange(tokens)
    return AttentionMetadata(
        positions=positions,
        slot_mapping=positions.clone(),
        cu_q_lens=torch.tensor([0, tokens], dtype=torch.int32),
        context_lens=torch.tensor([tokens], dtype=torch.int32),
        block_table=torch.tensor([[0]], dtype=torch.int32),
        last_token_indices=torch.tensor([tokens - 1]),
        max_q_len=tokens,
        max_context_len=tokens,
    )


def _run(attention: LlamaAttention, cos_sin: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    caches = [torch.zeros(1, 8, attention.num_kv_heads, attention.head_dim) for _ in range(2)]
    return attention(x, _prefill(x.shape[0]), cos_sin, *caches), *caches


def _unfused(attention: LlamaAttention, cos_sin: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ops, d = attention.ops, attention.head_dim
    caches = [torch.zeros(1, 8, attention.num_kv_heads, d) for _ in range(2)]
    meta = _prefill(x.shape[0])
    q, k, v = attention.qkv_proj(x).view(x.shape[0], -1, d).split(
        [attention.num_heads, attention.num_kv_heads, attention.num_kv_heads], dim=1
    )
    q = ops.rotary_kv_append(q, k, v, meta.positions, cos_sin, *caches, meta.slot_mapping)
    out = ops.paged_attention(q, *caches, meta, attention.scale, **attention.options)
    return attention.o_proj(out.reshape(x.shape[0], -1)), *caches


def test_a_plain_qkv_runs_with_rotary_and_the_append_and_a_quantized_one_does_not(
    tiny_checkpoints: dict[str, Path],
) -> None:
    calls: list[torch.Tensor] = []
    attention, cos_sin, hidden = _first_attention(tiny_checkpoints["llama"])
    fused = attention.ops.linear_rotary_kv_append
    attention.ops = _Spy(attention.ops, fused, calls)
    x = torch.randn(5, hidden)
    for got, want in zip(_run(attention, cos_sin, x), _unfused(attention, cos_sin, x)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert len(calls) == 1 and calls[0] is attention.qkv_proj.weight

    quantized, cos_sin, _ = _first_attention(tiny_checkpoints["llama"], quantization_mode="int8")
    quantized.ops = _Spy(quantized.ops, fused, calls)
    _run(quantized, cos_sin, x)
    assert len(calls) == 1  # an int8 q/k/v product is not x @ W^T: the unfused path


def test_per_head_qk_norms_sit_between_the_product_and_rotary(tiny_checkpoints: dict[str, Path]) -> None:
    calls: list[torch.Tensor] = []
    attention, cos_sin, hidden = _first_attention(tiny_checkpoints["qwen3"])
    attention.ops = _Spy(attention.ops, attention.ops.linear_rotary_kv_append, calls)
    _run(attention, cos_sin, torch.randn(3, hidden))
    assert calls == []  # Qwen3 norms q and k per head before rotary: the unfused path


class _Spy:
    """The op namespace with ``linear_rotary_kv_append`` recording the weight of each call."""

    def __init__(self, ops, fused, calls: list[torch.Tensor]) -> None:
        self._ops = ops
        self.linear_rotary_kv_append = lambda x, w, *rest: calls.append(w) or fused(x, w, *rest)

    def __getattr__(self, name: str):
        return getattr(self._ops, name)
