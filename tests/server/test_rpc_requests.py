"""Unit: one RPC's engine requests: deltas joined, errors final, leftovers aborted exactly once."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mii_server.errors import InvalidRequest
from mii_server.generation.params import GenerateParams
from mii_server.generation.response import FinishReason, Response
from mii_server.replica.rpc_requests import RpcRequests


@dataclass
class Update:
    uid: int
    response: Response | None
    error: Exception | None = None


class FakeEngine:
    """Records submits and aborts; the test drives updates through the captured sinks."""

    def __init__(self, reject: str | None = None) -> None:
        self.sinks: dict[int, object] = {}
        self.aborted: list[int] = []
        self.reject = reject

    def submit(self, prompt, params, sink) -> int:
        if prompt == self.reject:
            raise InvalidRequest("prompt too long")
        uid = 100 + len(self.sinks)
        self.sinks[uid] = sink
        return uid

    def abort(self, uid: int) -> None:
        self.aborted.append(uid)
        self.sinks[uid](Update(uid, Response("", 1, 0, FinishReason.ABORT)))


def chunk(text: str, n: int, reason: FinishReason = FinishReason.NONE) -> Response:
    return Response(text, 2, n, reason, [n])


def test_deltas_are_joined_per_prompt() -> None:
    engine = FakeEngine()
    reqs = RpcRequests(engine.submit, engine.abort)
    reqs.submit_all(["a", "b"], GenerateParams())
    s0, s1 = engine.sinks[100], engine.sinks[101]
    s1(Update(101, chunk("x", 1)))
    s0(Update(100, chunk("he", 1)))
    s0(Update(100, chunk("llo", 2, FinishReason.STOP)))
    s1(Update(101, chunk("y", 2, FinishReason.LENGTH)))
    seen = [(i, u.response.generated_text) for i, u in reqs.updates()]
    assert seen == [(1, "x"), (0, "he"), (0, "llo"), (1, "y")]
    assert reqs.result(0) == Response("hello", 2, 2, FinishReason.STOP, [1, 2])
    assert reqs.result(1) == Response("xy", 2, 2, FinishReason.LENGTH, [1, 2])
    reqs.abort_unfinished()
    assert engine.aborted == []  # nothing left to abort


def test_abort_unfinished_frees_only_running_prompts() -> None:
    engine = FakeEngine()
    reqs = RpcRequests(engine.submit, engine.abort)
    reqs.submit_all(["a", "b"], GenerateParams())
    engine.sinks[100](Update(100, chunk("done", 1, FinishReason.STOP)))
    updates = reqs.updates()
    next(updates)  # prompt 0 finished
    reqs.abort_unfinished()  # the client left
    assert engine.aborted == [101]
    assert [u.response.finish_reason for _, u in updates] == [FinishReason.ABORT]


def test_a_rejected_prompt_aborts_the_ones_already_submitted() -> None:
    engine = FakeEngine(reject="too long")
    reqs = RpcRequests(engine.submit, engine.abort)
    with pytest.raises(InvalidRequest):
        reqs.submit_all(["ok", "too long", "never"], GenerateParams())
    assert engine.aborted == [100] and len(engine.sinks) == 1


def test_an_error_update_is_final() -> None:
    engine = FakeEngine()
    reqs = RpcRequests(engine.submit, engine.abort)
    reqs.submit_all(["a"], GenerateParams())
    engine.sinks[100](Update(100, None, RuntimeError("boom")))
    [(index, update)] = list(reqs.updates())
    assert index == 0 and str(update.error) == "boom"
