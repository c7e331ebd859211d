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

    def iterate(self, stream: AsyncIterator[T], gone: Callable[[], bool]) -> Iterator[T]:
        """The items of an async iterator, as a plain iterator for this thread. Closing it early, or
        ``gone()`` turning true (``ClientGone``), cancels the stream on the loop."""
        items: queue.Queue[Any] = queue.Queue()

        async def pump() -> None:
            try:
                async for item in stream:
                    items.put(item)
            except BaseException as exc:
                items.put(exc)
                raise
            items.put(_END)

        future = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        try:
            while True:
                try:
                    item = items.get(timeout=POLL_S)
                except queue.Empty:
                    if gone():
                        raise ClientGone() from None
                    continue
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()  # no-op once the stream ended

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()
