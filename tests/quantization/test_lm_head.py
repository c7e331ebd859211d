"""The LM head's int8 copy (``quantization.lm_head``): what it holds, which steps read it, how it shards.

The layer is installed on CUDA devices only; here it runs with the reference ops, whose products are
the Triton ones' twins (tests/kernels/test_triton_quant.py checks the int8 logits kernel against them).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mii_server.kernels import reference
from mii_server.models.layers import ParallelLMHead
from mii_server.models.parallel import TensorParallelGroup
from mii_server.models.phi import BiasedLMHead
from mii_server.quantization.lm_head import INT8_HEAD_MAX_ROWS, Int8CopyLMHead, add_int8_head_copies
from mii_server.quantization.quantize import quantize_int8

VOCAB, HIDDEN = 301, 64  # a vocabulary that two ranks split with one padding row


def _loaded_head(checkpoint: torch.Tensor, tp: TensorParallelGroup, dtype: torch.dtype) -> Int8CopyLMHead:
    head = Int8CopyLMHead(ParallelLMHead(VOCAB, HIDDEN, tp, dtype, reference), reference)
    head.weight.weight_loader(head.weight, checkpoint)  # type: ignore[attr-defined]
    return head


@pytest.fixture
def checkpoint() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(VOCAB, HIDDEN) / HIDDEN**0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_copy_is_the_loaded_rows_quantized_per_row(checkpoint: torch.Tensor, dtype: torch.dtype) -> None:
    head = _loaded_head(checkpoint, TensorParallelGroup(), dtype)
    assert head.weight.dtype == dtype and torch.equal(head.weight, checkpoint.to(dtype))
    codes, scale = quantize_int8(checkpoint.to(dtype).float(), 0, HIDDEN)
    assert head.int8_weight.dtype == torch.int8 and torch.equal(head.int8_weight, codes)
    assert torch.equal(head.int8_scale, scale)
    # the buffers are not checkpoint parameters: the loader's "every parameter loaded" check ignores them
    assert [name for name, _ in head.named_parameters()] == ["weight"]


@pytest.mark.parametrize("rows", [1, 7, INT8_HEAD_MAX_ROWS, INT8_HEAD_MAX_ROWS + 1, 200])
def test_few_row_steps_read_the_copy_wider_ones_the_head(checkpoint: torch.Tensor, rows: int) -> None:
    head = _loaded_head(checkpoint, TensorParallelGroup(), torch.float32)
    x = torch.randn(rows, HIDDEN)
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (rows, VOCAB)
    int8_logits = reference.int8_linear(x, head.int8_weight, head.int8_scale)
    full_logits = nn.functional.linear(x, checkpoint)
    if rows <= INT8_HEAD_MAX_ROWS:
        assert torch.equal(logits, int8_logits)
        assert not torch.equal(logits, full_logits)  # the copy really was read
        # and it stays close to the head: one int8 step of each row's range
        assert (logits - full_logits).abs().max() < 0.05
    else:
        assert torch.equal(logits, full_logits)


def test_each_rank_copies_its_own_vocabulary_rows(checkpoint: torch.Tensor) -> None:
    whole = _loaded_head(checkpoint, TensorParallelGroup(), torch.float32)
    shards = [_loaded_head(checkpoint, TensorParallelGroup(rank, 2), torch.float32) for rank in (0, 1)]
    codes = torch.cat([shard.int8_weight for shard in shards])
    scales = torch.cat([shard.int8_scale for shard in shards])
    assert torch.equal(codes[:VOCAB], whole.int8_weight) and torch.equal(scales[:VOCAB], whole.int8_scale)
    assert not codes[VOCAB:].any()  # the padding row past the vocabulary holds zeros
    x = torch.randn(3, HIDDEN)
    per_rank = torch.cat([shard.shard_logits(x) for shard in shards], dim=1)[:, :VOCAB]
    torch.testing.assert_close(per_rank, whole(x))


def test_only_plain_heads_get_a_copy() -> None:
    tp = TensorParallelGroup()
    model = nn.Module()
    model.lm_head = ParallelLMHead(VOCAB, HIDDEN, tp, torch.float32, reference)
    model.inner = nn.Module()
    model.inner.biased = BiasedLMHead(VOCAB, HIDDEN, tp, torch.float32, reference)
    assert add_int8_head_copies(model, reference) == 1
    assert isinstance(model.lm_head, Int8CopyLMHead)
    assert type(model.inner.biased) is BiasedLMHead
