"""Pre-quantized fp8 checkpoints of the tiny test models, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from .prequantized import write_compressed_tensors_fp8, write_fine_grained_fp8

# name -> (tiny variant it quantizes, writer)
PREQUANTIZED = {
    "hf-fp8-block": ("llama", lambda src, out: write_fine_grained_fp8(src, out, (16, 16))),
    "hf-fp8-tensor": ("llama3", lambda src, out: write_fine_grained_fp8(src, out, None)),
    "ct-fp8-channel": ("qwen2", lambda src, out: write_compressed_tensors_fp8(src, out, "FP8_DYNAMIC")),
    "ct-fp8-tensor": ("llama", lambda src, out: write_compressed_tensors_fp8(src, out, "FP8")),
}


@pytest.fixture(scope="session")
def prequantized_checkpoints(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Path]]:
    """name -> (the fp8 checkpoint, the unquantized checkpoint it was made from)."""
    root = tmp_path_factory.mktemp("prequantized")
    return {
        name: (write(tiny_checkpoints[variant], root / name), tiny_checkpoints[variant])
        for name, (variant, write) in PREQUANTIZED.items()
    }
