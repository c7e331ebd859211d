"""The engine requests of one replica RPC: one sink per prompt, updates relayed to the event loop, leftovers aborted.

``RpcRequests`` is what makes "a cancelled RPC aborts its request" hold: the servicer calls
``abort_unfinished`` when the RPC ends (normally, by an error or by cancellation), which frees the KV
blocks of every prompt that has not finished. It talks to the engine only through the sinks it hands
out and an ``abort`` callable, so it is tested without torch.

Threads: sinks run on the batching thread; everything else runs on the event loop. A streamed RPC
relays every update and its consumer merges the updates that queued up while it was busy (one
message carries several tokens when the caller reads slower than the engine writes). A whole (unary)
RPC collects its deltas on the batching thread and relays only each prompt's final update.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ..batching.request import RequestUpdate, Sink
from ..generation.response import Response
from .relay import UpdateRelay

log = logging.getLogger(__name__)

# Called on the batching thread with (prompt index, update) before the update is relayed.
Observer = Callable[[int, RequestUpdate], None]
# Called on the event loop with (prompt index, final update) once per prompt.
OnFinal = Callable[[int, RequestUpdate], None]
# Called on the event loop with every (prompt index, update) of a streamed RPC, in order.
Forward = Callable[[int, RequestUpdate], None]


@dataclass
class _Progress:
    """What one prompt has produced so far (unary RPCs; written on the batching thread until final)."""

    uid: int | None = None
    chunks: list[Response] = field(default_factory=list)
    error: Exception | None = None
    finished: bool = False


class RpcRequests:
    """One RPC's prompts in flight on the engine."""

    def __init__(
        self,
        num_prompts: int,
        *,
        stream: bool,
        relay: UpdateRelay,
        abort: Callable[[int], None],
        observe: Observer | None = None,
        on_final: OnFinal | None = None,
        forward: Forward | None = None,
    ) -> None:
        """``forward`` (streamed RPCs): each update is handed to it on the event loop as it arrives,
        instead of being queued for ``updates()``."""
        self.stream = stream
        self._relay = relay
        self._abort = abort
        self._observe = observe
        self._on_final = on_final
        self._forward = forward
        self._progress = [_Progress() for _ in range(num_prompts)]
        self._unfinished = num_prompts  # prompts whose final update has not reached the loop
        self._queue: asyncio.Queue[tuple[int, RequestUpdate]] = asyncio.Queue()  # streamed updates
        self._settled = asyncio.Event()  # unary: every prompt finished, or one failed
        self._closed = False  # the RPC ended: late prompts are aborted as they are bound
        if num_prompts == 0:
            self._settled.set()

    # ---- batching thread -----------------------------------------------------------------------
    def sink(self, index: int) -> Sink:
        """The engine sink of prompt ``index``."""
        progress = self._progress[index]

        def streamed(update: RequestUpdate) -> None:
            if self._observe is not None:
                self._observe(index, update)
            self._relay.push(self._deliver, index, update)

        def collected(update: RequestUpdate) -> None:
            if self._observe is not None:
                self._observe(index, update)
            if update.response is not None:
                progress.chunks.append(update.response)
            if update.finished:
                progress.error = update.error
                self._relay.push(self._deliver, index, update)

        return streamed if self.stream else collected

    # ---- event loop ----------------------------------------------------------------------------
    def bind(self, index: int, uid: int) -> None:
        """Prompt ``index`` runs on the engine as ``uid``."""
        self._progress[index].uid = uid
        if self._closed:  # the RPC ended while its prompts were being prepared
            self._safe_abort(uid)

    def _deliver(self, index: int, update: RequestUpdate) -> None:
        if update.finished:
            self._progress[index].finished = True  # the loop sends exactly one final update per request
            self._unfinished -= 1
            if self._on_final is not None:
                self._on_final(index, update)
            if self._unfinished == 0 or update.error is not None:
                self._settled.set()
        if self._forward is not None:
            self._forward(index, update)
        elif self.stream:
            self._queue.put_nowait((index, update))

    async def updates(self) -> AsyncIterator[tuple[int, RequestUpdate]]:
        """(prompt index, update) until every prompt has had its final one. Updates of one prompt that
        queued up together are merged into one (deltas joined); an error update is final."""
        assert self.stream, "updates() is for streamed RPCs; use results()"
        remaining = len(self._progress)
        while remaining:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            for index, update in _merge(batch):
                if update.finished:
                    remaining -= 1
                yield index, update

    async def settled(self) -> None:
        """Until every prompt has finished, or one has failed."""
        await self._settled.wait()

    async def results(self) -> list[Response]:
        """Every prompt's whole Response, in order; raises the first prompt's error, if any."""
        assert not self.stream, "results() is for unary RPCs; use updates()"
        await self.settled()
        for progress in self._progress:
            if progress.error is not None:
                raise progress.error
        return [Response.join(p.chunks) for p in self._progress]

    def abort_unfinished(self) -> None:
        """Abort every bound prompt that has not finished (idempotent)."""
        self._closed = True
        for progress in self._progress:
            if progress.uid is not None and not progress.finished:
                self._safe_abort(progress.uid)

    def _safe_abort(self, uid: int) -> None:
        try:
            self._abort(uid)
        except Exception:  # the engine is gone: nothing left to free
            log.debug("abort of uid %d failed", uid, exc_info=True)


def _merge(batch: list[tuple[int, RequestUpdate]]) -> list[tuple[int, RequestUpdate]]:
    """Fold consecutive deltas of each prompt into one update, prompts in order of first appearance."""
    grouped: dict[int, list[RequestUpdate]] = {}
    for index, update in batch:
        grouped.setdefault(index, []).append(update)
    out = []
    for index, updates in grouped.items():
        if len(updates) == 1:
            out.append((index, updates[0]))
            continue
        last = updates[-1]
        if last.error is not None:
            out.append((index, last))
            continue
        joined = Response.join([u.response for u in updates if u.response is not None])
        out.append((index, RequestUpdate(last.uid, joined)))
    return out
