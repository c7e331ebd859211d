"""The engine requests of one replica RPC: submit every prompt, collect updates, abort the leftovers.

``RpcRequests`` is what makes "a cancelled RPC aborts its request" hold: the servicer registers
``abort_unfinished`` as the RPC's termination callback, which frees the KV blocks of every prompt
that has not finished. It talks to the engine only through the ``submit``/``abort`` callables, so
it is tested without torch.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..generation.params import GenerateParams
from ..generation.response import FinishReason, Response

log = logging.getLogger(__name__)


class Update(Protocol):
    """The engine driver's ``RequestUpdate``: a delta ``response`` or a final ``error``."""

    uid: int
    response: Response | None
    error: Exception | None


Submit = Callable[[str, GenerateParams, Callable[[Any], None]], int]


@dataclass
class _Progress:
    """What one prompt has produced so far."""

    uid: int | None = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    last: Response | None = None
    finished: bool = False


class RpcRequests:
    """One RPC's prompts in flight on the engine. Updates arrive on the batching thread."""

    def __init__(self, submit: Submit, abort: Callable[[int], None]) -> None:
        self._submit = submit
        self._abort = abort
        self._lock = threading.Lock()
        self._events: queue.Queue[tuple[int, Update]] = queue.Queue()
        self._progress: list[_Progress] = []
        self._closed = False  # the RPC ended: abort what remains, submit nothing more

    def submit_all(self, prompts: Sequence[str], params: GenerateParams) -> None:
        """Submit every prompt; on failure (e.g. prompt too long) abort the ones submitted and re-raise."""
        self._progress = [_Progress() for _ in prompts]
        try:
            for i, prompt in enumerate(prompts):
                uid = self._submit(prompt, params, lambda update, i=i: self._events.put((i, update)))
                with self._lock:
                    self._progress[i].uid = uid
                    closed = self._closed
                if closed:  # the client left while we were submitting
                    self._safe_abort(uid)
        except BaseException:
            self.abort_unfinished()
            raise

    def updates(self) -> Iterator[tuple[int, Update]]:
        """(prompt index, update) in arrival order, until every prompt has its final update."""
        remaining = sum(1 for p in self._progress if not p.finished)
        while remaining:
            index, update = self._events.get()
            final = update.error is not None or (
                update.response is not None and update.response.finish_reason != FinishReason.NONE
            )
            progress = self._progress[index]
            if update.response is not None:
                progress.text.append(update.response.generated_text)
                progress.token_ids.extend(update.response.token_ids)
                progress.last = update.response
            if final:
                with self._lock:
                    progress.finished = True
                remaining -= 1
            yield index, update

    def result(self, index: int) -> Response:
        """The whole output of a finished prompt (deltas joined)."""
        p = self._progress[index]
        assert p.finished and p.last is not None, "result() before the prompt finished"
        return Response(
            generated_text="".join(p.text),
            prompt_length=p.last.prompt_length,
            generated_length=p.last.generated_length,
            finish_reason=p.last.finish_reason,
            token_ids=list(p.token_ids),
        )

    def abort_unfinished(self) -> None:
        """Abort every submitted prompt that has not finished (idempotent; any thread)."""
        with self._lock:
            self._closed = True
            uids = [p.uid for p in self._progress if p.uid is not None and not p.finished]
        for uid in uids:
            self._safe_abort(uid)

    def _safe_abort(self, uid: int) -> None:
        try:
            self._abort(uid)
        except Exception:  # the request may have finished in between; nothing to free then
            log.debug("abort of uid %d failed", uid, exc_info=True)
