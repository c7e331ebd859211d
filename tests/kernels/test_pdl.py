"""Programmatic dependent launch (``kernels.pdl``): off on the CPU, on by default where supported,
checked settings, and on a Hopper GPU chains of our kernels (an fp8 step's, and a bf16 step's few-row
GEMMs that release their dependents after their main loop) replayed in a CUDA graph with PDL give
bit for bit what they give launched plainly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mii_server.kernels import pdl

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def test_pdl_is_off_on_the_cpu_and_on_by_default_where_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdl, "_weight_only_model_loaded", False)
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}  # no grid dependency control here
    monkeypatch.setattr(pdl, "_supported", lambda device: True)
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    assert pdl.pdl_launch(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    assert pdl.pdl_launch(torch.device("cuda")) == {"PDL": False}


def test_a_weight_only_model_turns_it_off_unless_forced_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdl, "_weight_only_model_loaded", False)
    monkeypatch.setattr(pdl, "_supported", lambda device: True)
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    pdl.off_for_weight_only_models()
    assert pdl.pdl_launch(torch.device("cuda")) == {"PDL": False}
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    assert pdl.pdl_launch(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}


def test_a_bad_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pdl.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="MII_SERVER_PDL must be 0 or 1"):
        pdl.pdl_launch(torch.device("cpu"))


def test_prefetch_lines_are_a_power_of_two_within_the_row() -> None:
    assert pdl.prefetch_lines(4096, 1024) == 8  # two 512-byte K tiles of an fp8 row
    assert pdl.prefetch_lines(14336, 2048) == 16
    assert pdl.prefetch_lines(1000, 2048) == 4  # 7 lines of the row, rounded down to a power of two
    assert pdl.prefetch_lines(64, 1024) == 0  # a row shorter than a line: nothing


def _decode_chain(x: torch.Tensor, residual: torch.Tensor, norm: torch.Tensor, w1, w2, w3) -> torch.Tensor:
    """A decoder MLP's kernels at one row as an fp8 step runs them: norm quantized, product, activation
    quantized, product, then the plain norm and dense product of the next step."""
    from mii_server.kernels import triton_ops as ops

    rows, stream = ops.rms_norm_fp8(x, norm, 1e-6, residual)
    h = ops.fp8_linear(rows, *w1)
    h = ops.fp8_linear(ops.silu_and_mul_fp8(h), *w2)
    out, _ = ops.rms_norm(h, norm, 1e-6, stream)
    return ops.dense_linear(out, w3)


@pytest.mark.skipif(not HOPPER, reason="PDL needs compute capability 9.0")
def test_a_graph_of_pdl_launches_equals_plain_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    dev, hidden, inter = torch.device("cuda"), 4096, 14336
    x, residual = (torch.randn(1, hidden, device=dev, dtype=torch.bfloat16) for _ in range(2))
    norm = torch.rand(hidden, device=dev, dtype=torch.bfloat16) + 0.5

    def fp8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randn(n, k, device=dev) / k**0.5
        scale = w.abs().amax(1, keepdim=True) / 448
        return (w / scale).to(torch.float8_e4m3fn), scale

    w1, w2 = fp8_weight(2 * inter, hidden), fp8_weight(hidden, inter)
    w3 = (torch.randn(hidden, hidden, device=dev) / hidden**0.5).to(torch.bfloat16)
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    want = _decode_chain(x, residual, norm, w1, w2, w3)
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    _decode_chain(x, residual, norm, w1, w2, w3)  # compile the PDL variants and make the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _decode_chain(x, residual, norm, w1, w2, w3)
    for _ in range(3):
        got.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


def _bf16_chain(x, residual, norm, qkv_weight, gate_up, down, rotary) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 layer's few-row GEMMs as a decode step runs them: norm, q/k/v with rotary and the KV
    append, norm, gate_up with its activation, down. Returns (q, the layer's output)."""
    from mii_server.kernels import triton_ops as ops

    h, stream = ops.rms_norm(x, norm, 1e-6, residual)
    q = ops.linear_rotary_kv_append(h, qkv_weight, None, *rotary)
    h, _ = ops.rms_norm(q.reshape(1, -1), norm, 1e-6, stream)
    return q, ops.dense_linear(ops.linear_silu_and_mul(h, gate_up), down)


@pytest.mark.skipif(not HOPPER, reason="PDL needs compute capability 9.0")
def test_a_graph_of_bf16_gemms_releasing_after_their_loop_equals_plain_launches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    dev, hidden, inter, d = torch.device("cuda"), 4096, 14336, 128

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=dev) / k**0.5).to(torch.bfloat16)

    x, residual = (torch.randn(1, hidden, device=dev, dtype=torch.bfloat16) for _ in range(2))
    norm = torch.rand(hidden, device=dev, dtype=torch.bfloat16) + 0.5
    weights = weight(48 * d, hidden), weight(2 * inter, hidden), weight(hidden, inter)
    freqs = torch.outer(torch.arange(64, device=dev).float(), 0.5 ** torch.arange(d // 2, device=dev).float())
    caches = [torch.zeros(4, 16, 8, d, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    positions, slots = torch.tensor([9], device=dev), torch.tensor([21], device=dev)
    rotary = (positions, torch.cat((freqs.cos(), freqs.sin()), dim=-1), *caches, slots)
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    want = _bf16_chain(x, residual, norm, *weights, rotary)
    want_caches = [c.clone() for c in caches]
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    _bf16_chain(x, residual, norm, *weights, rotary)  # compile the PDL variants
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _bf16_chain(x, residual, norm, *weights, rotary)
    for _ in range(3):
        for t in (*got, *caches):
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(g, w) for g, w in zip((*got, *caches), (*want, *want_caches)))
