"""UpdateRelay: hands work from the batching thread to the replica's asyncio event loop, one wake-up per step.

The batching thread produces an update for every running request at every step. Waking the event
loop once per update (``call_soon_threadsafe`` each time) would cost a self-pipe write and a loop
iteration per token of every request; instead ``push`` only appends to a list, and ``flush`` (called
by the batching thread once a step's updates are out) schedules one callback that runs them all. When
the loop is busy and has not run the previous batch yet, later pushes join it: under load the relay
coalesces on its own, never queueing more than one wake-up.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class UpdateRelay:
    """Calls pushed callables on ``loop``, in push order, batched per ``flush``. Thread-safe."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._scheduled = False  # a drain is queued on the loop and has not started yet

    def push(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop at the next ``flush`` (any thread; never blocks on the loop)."""
        with self._lock:
            self._pending.append((fn, args))

    def flush(self) -> None:
        """Wake the loop once for everything pushed so far (a no-op when nothing is pending or a wake-up
        is already queued)."""
        with self._lock:
            if not self._pending or self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: the process is shutting down, nobody reads updates
            with self._lock:
                self._scheduled = False
                self._pending.clear()

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._scheduled = False
        for fn, args in batch:
            try:
                fn(*args)
            except Exception:  # one broken consumer must not starve the others
                log.exception("relayed update failed")
