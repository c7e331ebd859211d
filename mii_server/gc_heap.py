"""Keep the garbage collector's pauses short in every process that runs an engine or serves.

A full (generation-2) collection is stop-the-world and walks every tracked object. A replica holds
hundreds of thousands of them from start-up (the model's modules, the tokenizer, the scheduler's
tables) that live as long as the process, so each full pass stalled every thread: 277-331 ms for
the 8B model's replica on the H200 machine (docs/BENCHMARKS.md, "garbage-collection pauses were the
gap"). A stall of the batching thread shows as an inter-token gap for every running request. ``freeze_startup_heap`` collects once and moves everything alive into
the permanent generation, which collections skip; what the serving loop allocates later is still
collected as before (vLLM, SGLang and TensorRT-LLM freeze their engine and server processes the same
way). The server processes freeze once set up, ``pipeline()`` once loaded (``Pipeline.destroy``
unfreezes, so the pipeline's memory can be collected). In the processes that are ours (servers,
benchmarks), any single pause long enough for a user to notice is then logged as a warning; not in
``pipeline()``'s, whose heap is mostly the user's.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

# a collection longer than this is logged as a warning. why 100 ms: after the freeze, a replica with
# 1,024 streams open still pauses 60-80 ms every ~1.5 s (what serving allocates); that is not news
# for an operator, a 300 ms start-up-heap walk is
LONG_PAUSE_S = 0.1
_muted = False  # unfreeze_and_collect is running: its pause is the caller's own


def freeze_startup_heap(process: str, report_pauses: bool = True) -> None:
    """Collect, then exempt every object alive now from later collections (call once, set up); with
    ``report_pauses``, warn from then on of every collection that pauses ``process`` longer than
    ``LONG_PAUSE_S``."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    if report_pauses and not any(isinstance(cb, _PauseWatch) for cb in gc.callbacks):
        gc.callbacks.append(_PauseWatch(process))
    log.info(
        "%s: %d start-up objects frozen out of garbage collection (%.0f ms)",
        process, gc.get_freeze_count(), (time.perf_counter() - start) * 1e3,
    )  # fmt: skip


def unfreeze_and_collect() -> None:
    """Make the frozen heap collectable again and collect it now (freeing what a destroyed engine
    held); this deliberate pause is not reported."""
    global _muted
    _muted = True
    try:
        gc.unfreeze()
        gc.collect()
    finally:
        _muted = False


class _PauseWatch:
    def __init__(self, process: str) -> None:
        self.process = process
        self.started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        paused = time.perf_counter() - self.started
        if paused > LONG_PAUSE_S and not _muted:
            log.warning(
                "%s: garbage collection of generation %d paused every thread for %.0f ms",
                self.process, info["generation"], paused * 1e3,
            )  # fmt: skip
