"""``mii_server.pipeline()``: the engine in this process, for scripts and tests."""

from __future__ import annotations

import gc
from typing import Any

import torch

from .batching.loop import GenerationLoop
from .batching.request import RequestUpdate
from .config import ModelConfig
from .errors import EngineDead
from .generation.params import GenerateParams
from .generation.response import FinishReason, Response
from .runtime import Runtime, build_loop, build_runtime


def merge_updates(updates: list[RequestUpdate]) -> Response:
    """Fold one request's delta updates into its whole Response (raising its error, if any)."""
    for update in updates:
        if update.error is not None:
            raise update.error
    chunks = [u.response for u in updates if u.response is not None]
    last = chunks[-1]
    return Response(
        generated_text="".join(c.generated_text for c in chunks),
        prompt_length=last.prompt_length,
        generated_length=last.generated_length,
        finish_reason=last.finish_reason,
        token_ids=[t for c in chunks for t in c.token_ids],
    )


class Pipeline:
    """Callable: ``pipe(prompts, **generate_kwargs) -> list[Response]`` in prompt order."""

    def __init__(self, config: ModelConfig, runtime: Runtime, loop: GenerationLoop) -> None:
        self.config = config
        self.runtime: Runtime | None = runtime
        self.loop: GenerationLoop | None = loop

    @property
    def tokenizer(self) -> Any:
        return self._live_loop().tokenizer

    def _live_loop(self) -> GenerationLoop:
        if self.loop is None:
            raise EngineDead("this pipeline was destroyed")
        return self.loop

    def __call__(self, prompts: str | list[str], **generate_kwargs: Any) -> list[Response]:
        loop = self._live_loop()
        params = GenerateParams.from_kwargs(**generate_kwargs)
        prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
        updates: dict[int, list[RequestUpdate]] = {}
        # Validate every prompt before queueing any, so a bad one leaves nothing behind.
        requests = [loop.prepare(p, params, lambda u: updates[u.uid].append(u)) for p in prompt_list]
        for req in requests:
            updates[req.uid] = []
        loop.enqueue(requests)
        while any(not u or not u[-1].finished for u in updates.values()):
            loop.step()
        while loop.has_work():  # free the finished sequences' blocks
            loop.step()
        return [merge_updates(updates[req.uid]) for req in requests]

    def destroy(self) -> None:
        """Free the model and its KV cache; later calls raise EngineDead."""
        if self.loop is not None:
            self.loop.executor.close()
        self.loop = None
        self.runtime = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def pipeline(model_name_or_path: str = "", **model_kwargs: Any) -> Pipeline:
    """Load ``model_name_or_path`` (empty: the built-in demo model) into this process."""
    config = ModelConfig.from_kwargs(model_name_or_path, **model_kwargs)
    runtime = build_runtime(config)
    return Pipeline(config, runtime, build_loop(config, runtime))


__all__ = ["FinishReason", "Pipeline", "Response", "pipeline"]
