"""Which GPUs each replica sees (``CUDA_VISIBLE_DEVICES``), without importing torch."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

log = logging.getLogger(__name__)


def visible_gpus() -> list[str]:
    """GPU ids this process may hand out: ``CUDA_VISIBLE_DEVICES`` if set, else ``nvidia-smi -L``."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], check=False, capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def replica_gpus(
    replica_num: int, tensor_parallel: int, explicit: list[list[int]], device: str = "auto"
) -> list[list[str]] | None:
    """GPU ids per replica, or None for a CPU deployment (no GPUs, or ``device='cpu'``).

    ``explicit`` (from ``device_map``) indexes the visible GPUs; 'auto' gives replica i the contiguous
    group ``[i*T, (i+1)*T)``. Raises ValueError when the deployment needs more GPUs than are visible.
    """
    gpus = [] if device == "cpu" else visible_gpus()
    if not gpus:
        if device == "cuda":
            raise ValueError("device='cuda' was asked for, but no GPU is visible")
        return None
    if explicit:
        bad = sorted({i for group in explicit for i in group if i >= len(gpus) or i < 0})
        if bad:
            raise ValueError(f"device_map names GPUs {bad}, but only {len(gpus)} are visible")
        return [[gpus[i] for i in group] for group in explicit]
    needed = replica_num * tensor_parallel
    if needed > len(gpus):
        raise ValueError(
            f"{replica_num} replica(s) x tensor_parallel={tensor_parallel} need {needed} GPUs, but "
            f"{len(gpus)} are visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
            "lower replica_num or tensor_parallel, or pass device='cpu'"
        )
    return [gpus[i * tensor_parallel : (i + 1) * tensor_parallel] for i in range(replica_num)]
