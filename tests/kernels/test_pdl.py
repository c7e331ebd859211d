"""Programmatic dependent launch (``kernels.pdl``): off on the CPU and by default, checked settings,
and on a Hopper GPU a chain of our kernels replayed in a CUDA graph with PDL gives bit for bit what it
gives launched plainly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mii_server.kernels import pdl

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def test_pdl_is_off_on_the_cpu_and_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    monkeypatch.setattr(pdl, "_fp8_model_loaded", False)
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}
    if HOPPER:
        assert pdl.pdl_launch(torch.device("cuda")) == {"PDL": False}
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    assert pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}  # no grid dependency control here


def test_the_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pdl.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="MII_SERVER_PDL must be 0 or 1"):
        pdl.pdl_launch(torch.device("cpu"))


def test_an_fp8_model_turns_it_on_unless_forced_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdl, "_fp8_model_loaded", False)
    monkeypatch.setattr(pdl, "_supported", lambda device: True)
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    pdl.enable_for_fp8_models()
    assert pdl.pdl_launch(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    assert pdl.pdl_launch(torch.device("cuda")) == {"PDL": False}


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
