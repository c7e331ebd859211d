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


def replica_gpus(replica_num: int, tensor_parallel: int, explicit: list[list[int]]) -> list[list[str]] | None:
    """GPU ids per replica, or None when there are no GPUs (CPU deployment: leave the env alone).

    ``explicit`` (from ``device_map``) indexes the visible GPUs; 'auto' gives replica i the contiguous
    group ``[i*T, (i+1)*T)``, wrapping around (and sharing GPUs) when there are too few.
    """
    gpus = visible_gpus()
    if not gpus:
        return None
    if explicit:
        bad = sorted({i for group in explicit for i in group if i >= len(gpus) or i < 0})
        if bad:
            raise ValueError(f"device_map names GPUs {bad}, but only {len(gpus)} are visible")
        return [[gpus[i] for i in group] for group in explicit]
    needed = replica_num * tensor_parallel
    if needed > len(gpus):
        log.warning(
            "%d replicas x %d ranks need %d GPUs; %d visible: replicas will share GPUs",
            replica_num,
            tensor_parallel,
            needed,
            len(gpus),
        )
    return [
        [gpus[(i * tensor_parallel + k) % len(gpus)] for k in range(tensor_parallel)]
        for i in range(replica_num)
    ]
