"""EngineDriver: the replica's GenerationLoop on a background thread, fed from any thread.

gRPC handler threads call ``submit``/``abort``; the batching thread steps the loop whenever there is
work and sleeps (no spinning) when there is none. Every request submitted by any caller shares the
same batches: that is continuous batching across RPCs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..batching.executor import StepExecutor
from ..batching.request import RequestUpdate
from ..config import ModelConfig
from ..errors import EngineDead
from ..generation.params import GenerateParams
from ..runtime import Runtime, build_loop, build_runtime
from ..tensor_parallel.executor import HEARTBEAT_S

log = logging.getLogger(__name__)

__all__ = ["EngineDriver", "EngineStats", "RequestUpdate"]


@dataclass
class EngineStats:
    running: int  # requests with KV in the cache
    waiting: int  # queued or preempted requests
    free_blocks: int  # KV blocks free now
    total_blocks: int  # KV blocks in the cache
    requests_finished: int  # since start (finished, aborted or failed)
    prompt_tokens: int  # prompt tokens of all requests accepted since start
    generated_tokens: int  # tokens sampled since start
    preemptions: int  # requests preempted (and recomputed) since start
    cached_prompt_tokens: int  # prompt tokens taken from the prefix cache since start


class EngineDriver:
    def __init__(
        self,
        config: ModelConfig,
        runtime: Runtime | None = None,
        executor: StepExecutor | None = None,
    ) -> None:
        """Load the model (unless ``runtime`` is given) and start the batching thread."""
        self.config = config
        self.runtime = runtime or build_runtime(config)
        self.loop = build_loop(config, self.runtime, executor)
        self._stopping = threading.Event()
        self._failure: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="batching-loop", daemon=True)
        self._thread.start()

    def tokenizer(self) -> Any:
        return self.runtime.tokenizer

    @property
    def context_length(self) -> int:
        return self.runtime.context_length

    def submit(
        self,
        prompt: str | list[int],
        params: GenerateParams,
        sink: Callable[[RequestUpdate], None],
        stream: bool = True,
    ) -> int:
        """Queue one prompt; raises InvalidRequest at once for a bad one, EngineDead after shutdown.

        ``stream=False``: the sink still gets an update per token, but the text comes whole with the
        final one (decoded once instead of token by token).
        """
        if self._stopping.is_set() or self._failure is not None:
            raise EngineDead(f"the engine is not running ({self._failure or 'shut down'})")
        return self.loop.submit(prompt, params, sink, stream)

    def abort(self, uid: int) -> None:
        self.loop.abort(uid)

    def stats(self) -> EngineStats:
        s = self.loop.stats()
        return EngineStats(**vars(s))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._failure is None

    def shutdown(self) -> None:
        """Stop the thread; every unfinished request gets EngineDead."""
        self._stopping.set()
        self.loop.abort(-1)  # wakes the thread
        self._thread.join()
        self.loop.executor.close()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self.loop.wait_for_work(timeout=HEARTBEAT_S)
                if not self.loop.has_work():
                    self.loop.executor.idle()
                while self.loop.has_work() and not self._stopping.is_set():
                    self.loop.step()
            self.loop.fail_all(EngineDead("the engine was shut down"))
        except Exception as err:  # the loop itself broke: nothing more can run
            log.exception("batching loop died")
            self._failure = err
            self.loop.fail_all(EngineDead(f"batching loop died: {err}"))
