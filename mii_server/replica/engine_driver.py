"""EngineDriver: the replica's GenerationLoop on a background thread, fed from any thread.

The servicer prepares requests (tokenisation, limits) off the event loop and enqueues them; the
batching thread steps the loop whenever there is work and sleeps (no spinning) when there is none.
Every request enqueued by any caller shares the same batches: that is continuous batching across
RPCs. After every step the driver calls ``after_step`` (the relay's flush), so the updates a step
produced reach the event loop in one wake-up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..batching.executor import StepExecutor
from ..batching.request import Request, Sink
from ..config import ModelConfig
from ..errors import EngineDead
from ..generation.params import GenerateParams
from ..runtime import Runtime, build_loop, build_runtime
from ..tensor_parallel.executor import HEARTBEAT_S
from ..wire.types import EngineStats

log = logging.getLogger(__name__)


class EngineDriver:
    def __init__(
        self,
        config: ModelConfig,
        runtime: Runtime | None = None,
        executor: StepExecutor | None = None,
        after_step: Callable[[], None] = lambda: None,
    ) -> None:
        """Load the model (unless ``runtime`` is given) and start the batching thread."""
        self.config = config
        self.runtime = runtime or build_runtime(config)
        self.loop = build_loop(config, self.runtime, executor)
        self._after_step = after_step
        self._stopping = threading.Event()
        self._failure: Exception | None = None
        self._step_started: float | None = None  # monotonic start of the step running now
        self._thread = threading.Thread(target=self._run, name="batching-loop", daemon=True)
        self._thread.start()

    def tokenizer(self) -> Any:
        return self.runtime.tokenizer

    @property
    def context_length(self) -> int:
        return self.runtime.context_length

    def prepare_many(
        self, prompts: list[str | list[int]], params: GenerateParams, sinks: list[Sink], stream: bool
    ) -> list[Request]:
        """Tokenise (texts in one batch) and validate an RPC's prompts (any thread; raises
        ``InvalidRequest``); nothing is queued.

        ``stream=False``: the sink still gets an update per token, but the text comes whole with the
        final one (decoded once instead of token by token).
        """
        self._check_running()
        return self.loop.prepare_many(prompts, params, sinks, stream)

    def enqueue(self, requests: list[Request]) -> None:
        """Hand prepared requests to the batching thread (``EngineDead`` after shutdown)."""
        self._check_running()
        self.loop.enqueue(requests)

    def abort(self, uid: int) -> None:
        self.loop.abort(uid)

    def stats(self) -> EngineStats:
        return self.loop.stats()

    @property
    def busy_step_s(self) -> float:
        """How long the step running now has run (0 between steps): what a hung engine shows."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._failure is None

    def shutdown(self) -> None:
        """Stop the thread; every unfinished request gets EngineDead."""
        self._stopping.set()
        self.loop.abort(-1)  # wakes the thread
        self._thread.join()
        self.loop.executor.close()

    def _check_running(self) -> None:
        if self._stopping.is_set() or self._failure is not None:
            raise EngineDead(f"the engine is not running ({self._failure or 'shut down'})")

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self.loop.wait_for_work(timeout=HEARTBEAT_S)
                if not self.loop.has_work():
                    self.loop.executor.idle()
                while self.loop.has_work() and not self._stopping.is_set():
                    self._step_started = time.monotonic()
                    self.loop.step()
                    self._step_started = None
                    self._after_step()
            self.loop.fail_all(EngineDead("the engine was shut down"))
        except Exception as err:  # the loop itself broke: nothing more can run
            log.exception("batching loop died")
            self._failure = err
            self.loop.fail_all(EngineDead(f"batching loop died: {err}"))
        finally:
            self._after_step()
