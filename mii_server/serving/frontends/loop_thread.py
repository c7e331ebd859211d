"""LoopThread: one asyncio event loop on a daemon thread, for synchronous code that drives async calls.

The REST gateway is a WSGI app (Flask): each request has its thread. Its upstream gRPC calls all run
on this one loop instead, so a request thread only waits on its own future or queue, in short slices,
and can give up the moment its client is gone (cancelling the call, which aborts its prompts on the
replicas). No thread is spent pumping a stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

POLL_S = 0.1  # how often a waiting request thread checks whether its client is still there


class ClientGone(Exception):
    """The HTTP client closed its connection while its request was waiting."""


_END = object()


class LoopThread:
    def __init__(self, name: str = "upstream-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (its exception is raised here)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, coro: Coroutine[Any, Any, T], gone: Callable[[], bool]) -> T:
        """Like ``run``, but cancel ``coro`` and raise ``ClientGone`` as soon as ``gone()`` says so."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        while True:
            try:
                return future.result(POLL_S)
            except concurrent.futures.TimeoutError:
                if gone():
                    future.cancel()
                    raise ClientGone() from None

    def iterate_batches(self, stream: AsyncIterator[T], gone: Callable[[], bool]) -> Iterator[list[T]]:
        """The items of an async iterator, for this thread, in batches: each batch holds every item
        that had arrived by the time it is taken (at least one). A consumer that falls behind thus
        catches up in fewer, larger hand-offs instead of one thread wake-up per item. The stream starts
        at once; closing the iterator early, or ``gone()`` turning true (``ClientGone``), cancels it
        on the loop (so iterate what this returns)."""
        items: queue.SimpleQueue[Any] = queue.SimpleQueue()

        async def pump() -> None:
            try:
                async for item in stream:
                    items.put(item)
            except BaseException as exc:
                items.put(exc)
                raise
            items.put(_END)

        return _batches(items, asyncio.run_coroutine_threadsafe(pump(), self.loop), gone)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


def _batches(
    items: queue.SimpleQueue[Any], pump: concurrent.futures.Future[None], gone: Callable[[], bool]
) -> Iterator[list[Any]]:
    """``iterate_batches``' reading side: ``items`` until the end marker, raising what ``pump`` failed
    with; cancels ``pump`` when left."""
    try:
        while True:
            try:
                batch = [items.get(timeout=POLL_S)]
            except queue.Empty:
                if gone():
                    raise ClientGone() from None
                continue
            while not items.empty():
                batch.append(items.get_nowait())
            for i, item in enumerate(batch):
                if item is _END or isinstance(item, BaseException):
                    if i:
                        yield batch[:i]  # what arrived before the end or the failure
                    if item is _END:
                        return
                    raise item
            yield batch
    finally:
        pump.cancel()  # no-op once the stream ended
