"""LoopThread.iterate_batches: an async stream read from a plain thread, in batches of what arrived."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import pytest

from mii_server.serving.frontends.loop_thread import ClientGone, LoopThread


@pytest.fixture(scope="module")
def upstream() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


def test_what_arrived_while_the_reader_was_away_comes_in_one_batch(upstream: LoopThread) -> None:
    parked = threading.Event()  # the stream has handed over items 1..4 and waits
    release: asyncio.Future[None] | None = None

    async def stream() -> AsyncIterator[int]:
        nonlocal release
        release = asyncio.get_running_loop().create_future()
        yield 0
        for item in range(1, 5):
            yield item
        parked.set()
        await release
        yield 5

    batches = upstream.iterate_batches(stream(), lambda: False)  # the stream starts at once
    assert parked.wait(10)
    assert next(batches) == [0, 1, 2, 3, 4]  # every waiting item, in one hand-off
    upstream.loop.call_soon_threadsafe(release.set_result, None)
    assert list(batches) == [[5]]


def test_items_before_a_failure_are_delivered_then_it_is_raised(upstream: LoopThread) -> None:
    async def stream() -> AsyncIterator[int]:
        yield 1
        yield 2
        raise ValueError("upstream lost")

    got: list[int] = []
    with pytest.raises(ValueError, match="upstream lost"):
        for batch in upstream.iterate_batches(stream(), lambda: False):
            got += batch
    assert got == [1, 2]


def test_a_gone_client_cancels_the_stream(upstream: LoopThread) -> None:
    cancelled = threading.Event()

    async def stream() -> AsyncIterator[int]:
        try:
            yield 1
            await asyncio.sleep(60)
        finally:
            cancelled.set()

    gone = threading.Event()
    batches = upstream.iterate_batches(stream(), gone.is_set)
    assert next(batches) == [1]
    gone.set()
    with pytest.raises(ClientGone):
        next(batches)
    batches.close()
    assert cancelled.wait(10)
