"""The server processes' start-up heap is frozen out of garbage collection, and a long pause is logged."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_freeze_exempts_the_start_up_heap_and_long_pauses_are_logged() -> None:
    script = textwrap.dedent(
        """
        import gc, logging
        from mii_server import gc_heap
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        start_up = [[i] for i in range(200_000)]  # tracked objects alive at start-up
        gc_heap.freeze_startup_heap("probe")
        assert gc.get_freeze_count() >= len(start_up), gc.get_freeze_count()
        later = [[i] for i in range(100_000)]  # made after the freeze: collections still walk these
        gc_heap.LONG_PAUSE_S = 0.0  # every pause counts as long: the warning's path runs
        gc.collect()
        assert later
        """
    )
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "INFO probe: " in out.stderr and "start-up objects frozen out of garbage collection" in out.stderr
    assert "WARNING probe: garbage collection of generation 2 paused every thread for" in out.stderr


def test_pipeline_freezes_once_loaded_and_destroy_unfreezes() -> None:
    script = textwrap.dedent(
        """
        import gc, logging
        import mii_server
        from mii_server import gc_heap
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        pipe = mii_server.pipeline("")
        frozen = gc.get_freeze_count()
        assert frozen > 10_000, frozen  # the model, the tokenizer, the engine's tables
        assert pipe("The list of", max_new_tokens=4)[0].generated_length == 4
        gc_heap.LONG_PAUSE_S = 0.0  # any reported pause would show: the user's process gets none
        later = [[i] for i in range(100_000)]
        gc.collect()
        pipe.destroy()
        assert gc.get_freeze_count() == 0, gc.get_freeze_count()
        assert later
        """
    )
    out = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "INFO pipeline: " in out.stderr and "paused every thread" not in out.stderr, out.stderr
