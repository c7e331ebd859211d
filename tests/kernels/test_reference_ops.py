"""Reference-op contracts that the Triton twins share (checked here without Triton)."""

from __future__ import annotations

import torch

from mii_server.kernels import reference


def test_kv_append_skips_negative_slots() -> None:
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    k = torch.ones(3, 1, 2)
    v = 2 * torch.ones(3, 1, 2)
    reference.kv_append(k, v, k_cache, v_cache, torch.tensor([5, -1, 0]))
    written = k_cache.view(-1, 2).sum(-1)
    assert written.nonzero().flatten().tolist() == [0, 5]  # slot 7 (what -1 would index) untouched
    assert v_cache.view(-1, 2)[[0, 5]].eq(2).all()
