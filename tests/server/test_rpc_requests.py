"""Unit: one RPC's engine requests: updates relayed from another thread, deltas merged, errors final,
leftovers aborted exactly once (no torch: the "engine" is this test calling the sinks)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mii_server.batching.request import RequestUpdate
from mii_server.generation.response import FinishReason, Response
from mii_server.replica.relay import UpdateRelay
from mii_server.replica.rpc_requests import RpcRequests


def chunk(text: str, n: int, reason: FinishReason = FinishReason.NONE) -> Response:
    return Response(text, 2, n, reason, [n])


def on_batching_thread(fn) -> None:
    """Run ``fn`` on another thread, as the engine's sinks run, and wait for it."""
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


async def collect(reqs: RpcRequests) -> list[tuple[int, RequestUpdate]]:
    return [item async for item in reqs.updates()]


def test_streamed_updates_arrive_in_order_and_queued_ones_merge() -> None:
    async def main() -> None:
        relay = UpdateRelay(asyncio.get_running_loop())
        finals: list[int] = []
        reqs = RpcRequests(2, stream=True, relay=relay, abort=lambda uid: None, on_final=lambda i, u: finals.append(i))
        reqs.bind(0, 100)
        reqs.bind(1, 101)
        s0, s1 = reqs.sink(0), reqs.sink(1)

        def step1() -> None:
            s1(RequestUpdate(101, chunk("x", 1)))
            s0(RequestUpdate(100, chunk("he", 1)))
            relay.flush()

        on_batching_thread(step1)
        consumer = reqs.updates()
        first = [await consumer.__anext__(), await consumer.__anext__()]
        assert [(i, u.response.generated_text) for i, u in first] == [(1, "x"), (0, "he")]

        def steps_while_the_reader_is_busy() -> None:
            s0(RequestUpdate(100, chunk("l", 2)))
            relay.flush()
            s0(RequestUpdate(100, chunk("lo", 3, FinishReason.STOP)))
            s1(RequestUpdate(101, chunk("y", 2, FinishReason.LENGTH)))
            relay.flush()

        on_batching_thread(steps_while_the_reader_is_busy)
        rest = [item async for item in consumer]
        assert [(i, u.response) for i, u in rest] == [
            (0, Response("llo", 2, 3, FinishReason.STOP, [2, 3])),  # two steps' deltas in one update
            (1, chunk("y", 2, FinishReason.LENGTH)),
        ]
        assert sorted(finals) == [0, 1]

    asyncio.run(main())


def test_unary_results_are_whole_and_relay_only_final_updates() -> None:
    async def main() -> None:
        relay = UpdateRelay(asyncio.get_running_loop())
        delivered: list[int] = []
        reqs = RpcRequests(2, stream=False, relay=relay, abort=lambda uid: None, on_final=lambda i, u: delivered.append(i))
        s0, s1 = reqs.sink(0), reqs.sink(1)

        def steps() -> None:
            s0(RequestUpdate(100, chunk("", 1)))
            s1(RequestUpdate(101, chunk("", 1)))
            relay.flush()
            assert relay._pending == [] and not relay._scheduled  # nothing to wake the loop for yet
            s0(RequestUpdate(100, chunk("hello", 2, FinishReason.STOP)))
            s1(RequestUpdate(101, chunk("xy", 2, FinishReason.LENGTH)))
            relay.flush()

        on_batching_thread(steps)
        assert await reqs.results() == [
            Response("hello", 2, 2, FinishReason.STOP, [1, 2]),
            Response("xy", 2, 2, FinishReason.LENGTH, [1, 2]),
        ]
        assert delivered == [0, 1]

    asyncio.run(main())


def test_a_failed_prompt_settles_a_unary_rpc_at_once() -> None:
    async def main() -> None:
        relay = UpdateRelay(asyncio.get_running_loop())
        reqs = RpcRequests(2, stream=False, relay=relay, abort=lambda uid: None)

        def fail_one() -> None:
            reqs.sink(1)(RequestUpdate(101, None, RuntimeError("boom")))
            relay.flush()

        on_batching_thread(fail_one)  # prompt 0 is still running
        with pytest.raises(RuntimeError, match="boom"):
            await asyncio.wait_for(reqs.results(), 5)

    asyncio.run(main())


def test_abort_unfinished_frees_only_running_prompts_and_late_binds() -> None:
    async def main() -> None:
        relay = UpdateRelay(asyncio.get_running_loop())
        aborted: list[int] = []
        reqs = RpcRequests(3, stream=True, relay=relay, abort=aborted.append)
        reqs.bind(0, 100)
        reqs.bind(1, 101)

        def finish_first() -> None:
            reqs.sink(0)(RequestUpdate(100, chunk("done", 1, FinishReason.STOP)))
            relay.flush()

        on_batching_thread(finish_first)
        consumer = reqs.updates()
        index, update = await consumer.__anext__()
        assert index == 0 and update.finished
        reqs.abort_unfinished()  # the caller left
        assert aborted == [101]
        reqs.bind(2, 102)  # a prompt bound after the RPC ended is aborted at once
        assert aborted == [101, 102]
        assert 100 not in aborted  # finished prompts are never aborted

    asyncio.run(main())


def test_an_error_update_is_final_and_ends_the_stream() -> None:
    async def main() -> None:
        relay = UpdateRelay(asyncio.get_running_loop())
        reqs = RpcRequests(1, stream=True, relay=relay, abort=lambda uid: None)

        def fail() -> None:
            reqs.sink(0)(RequestUpdate(100, chunk("a", 1)))
            reqs.sink(0)(RequestUpdate(100, None, RuntimeError("boom")))
            relay.flush()

        on_batching_thread(fail)
        [(index, update)] = await collect(reqs)
        assert index == 0 and str(update.error) == "boom"

    asyncio.run(main())


def test_a_relay_to_a_closed_loop_drops_updates_quietly() -> None:
    loop = asyncio.new_event_loop()
    relay = UpdateRelay(loop)
    loop.close()
    relay.push(lambda: None)
    relay.flush()  # the replica is shutting down: nobody reads, nothing raises
    assert relay._pending == []


def test_forward_takes_every_update_in_order_and_the_rpc_settles_on_the_last_final() -> None:
    async def main() -> None:
        relay = UpdateRelay(asyncio.get_running_loop())
        got: list[tuple[int, str]] = []
        reqs = RpcRequests(
            2, stream=True, relay=relay, abort=lambda uid: None,
            forward=lambda i, u: got.append((i, u.response.generated_text)),
        )  # fmt: skip
        s0, s1 = reqs.sink(0), reqs.sink(1)

        def one_step_then_another() -> None:
            s0(RequestUpdate(100, chunk("a", 1)))
            s1(RequestUpdate(101, chunk("b", 1, FinishReason.STOP)))
            relay.flush()
            s0(RequestUpdate(100, chunk("c", 2, FinishReason.LENGTH)))
            relay.flush()

        on_batching_thread(one_step_then_another)
        await asyncio.wait_for(reqs.settled(), 5)
        assert got == [(0, "a"), (1, "b"), (0, "c")]  # one by one, none merged, none queued

    asyncio.run(main())
