"""``mii_server.pipeline()``: the engine in this process, for scripts and tests."""

from __future__ import annotations

import os
from typing import Any

import torch

from . import gc_heap
from .batching.loop import GenerationLoop
from .batching.request import RequestUpdate
from .config import ModelConfig
from .errors import EngineDead, InvalidRequest
from .generation.params import GenerateParams
from .generation.response import FinishReason, Response
from .runtime import Runtime, build_loop, build_runtime, pick_device
from .tensor_parallel.channel import StepSubscriber
from .tensor_parallel.distributed import shutdown as tp_shutdown
from .tensor_parallel.distributed import torchrun_rank
from .tensor_parallel.executor import BroadcastExecutor, follow
from .tensor_parallel.ranks import RankPlacement, start_rank

# MII's zmq_port_number: where rank 0 of a torchrun pipeline publishes its steps.
DEFAULT_ZMQ_PORT = 25555


def merge_updates(updates: list[RequestUpdate]) -> Response:
    """Fold one request's delta updates into its whole Response (raising its error, if any)."""
    for update in updates:
        if update.error is not None:
            raise update.error
    return Response.join([u.response for u in updates if u.response is not None])


class Pipeline:
    """Callable: ``pipe(prompts, **generate_kwargs) -> list[Response]`` in prompt order."""

    def __init__(
        self, config: ModelConfig, runtime: Runtime, loop: GenerationLoop, all_rank_output: bool = False
    ) -> None:
        self.config = config
        self.runtime: Runtime | None = runtime
        self.loop: GenerationLoop | None = loop
        self.all_rank_output = all_rank_output  # tensor parallel: followers return the responses too

    @property
    def tokenizer(self) -> Any:
        return self._live_loop().tokenizer

    def _live_loop(self) -> GenerationLoop:
        if self.loop is None:
            raise EngineDead("this pipeline was destroyed")
        return self.loop

    def __call__(self, prompts: str | list[str], **generate_kwargs: Any) -> list[Response]:
        loop = self._live_loop()
        responses: list[Response] | None = None
        try:
            responses = self._generate(loop, prompts, generate_kwargs)
            return responses
        finally:  # even when a prompt is refused: the followers must not wait for a step forever
            if isinstance(loop.executor, BroadcastExecutor):
                share = self.all_rank_output and responses is not None
                loop.executor.release_followers([r.to_msg_dict() for r in responses] if share else None)

    @staticmethod
    def _generate(loop: GenerationLoop, prompts: str | list[str], generate_kwargs: dict[str, Any]) -> list[Response]:
        params = GenerateParams.from_kwargs(**generate_kwargs)
        prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
        updates: dict[int, list[RequestUpdate]] = {}

        def collect(update: RequestUpdate) -> None:
            updates[update.uid].append(update)

        # Validate every prompt before queueing any, so a bad one leaves nothing behind.
        requests = loop.prepare_many(prompt_list, params, [collect] * len(prompt_list), stream=False)
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
        tp_shutdown()
        gc_heap.unfreeze_and_collect()  # why: pipeline() froze the heap; what it held must be freed
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class FollowerPipeline:
    """Ranks 1..T-1 of a tensor-parallel pipeline: each call follows rank 0's steps and returns []."""

    def __init__(self, runtime: Runtime, subscriber: StepSubscriber) -> None:
        self.runtime: Runtime | None = runtime
        self.subscriber = subscriber

    def __call__(self, prompts: str | list[str], **generate_kwargs: Any) -> list[Response]:
        if self.runtime is None:
            raise EngineDead("this pipeline was destroyed")
        GenerateParams.from_kwargs(**generate_kwargs)  # the same errors as rank 0, on every rank
        end = follow(self.runtime.engine, self.subscriber, self.runtime.tp)
        return [] if end.responses is None else [Response.from_msg_dict(d) for d in end.responses]

    def destroy(self) -> None:
        self.subscriber.close()
        self.runtime = None
        tp_shutdown()
        gc_heap.unfreeze_and_collect()


def pipeline(
    model_name_or_path: str = "", all_rank_output: bool = False, **model_kwargs: Any
) -> Pipeline | FollowerPipeline:
    """Load ``model_name_or_path`` (empty: the built-in demo model) into this process.

    With ``tensor_parallel=T > 1`` the script must run as T processes (``torchrun --nproc-per-node T
    script.py``): every rank calls the pipeline alike; rank 0 returns the responses, the others []
    (or the same responses, with ``all_rank_output=True``, as in MII).

    Once loaded, the process's heap is frozen out of garbage collection (``gc.freeze``, as vLLM's
    engine does in process), so full collections no longer stall generation for the model's
    hundreds of thousands of objects. ``destroy()`` unfreezes it, so the pipeline's memory can be
    collected; call ``gc.unfreeze()`` yourself to undo it earlier.
    """
    config = ModelConfig.from_kwargs(model_name_or_path, **model_kwargs)
    if config.tensor_parallel == 1:
        runtime = build_runtime(config)
        pipe = Pipeline(config, runtime, build_loop(config, runtime))
        gc_heap.freeze_startup_heap("pipeline", report_pauses=False)
        return pipe
    ranks = torchrun_rank()
    if ranks is None or ranks[2] != config.tensor_parallel:
        raise InvalidRequest(
            f"tensor_parallel={config.tensor_parallel} in a script needs {config.tensor_parallel} processes: "
            f"run it with `torchrun --nproc-per-node {config.tensor_parallel} script.py`"
            + ("" if ranks is None else f" (this launcher started {ranks[2]})")
        )
    rank, local_rank, world = ranks
    placement = RankPlacement(
        rank=rank,
        world_size=world,
        device=pick_device(config, local_rank),
        channel_host=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        channel_port=int(os.environ.get("MII_SERVER_ZMQ_PORT", DEFAULT_ZMQ_PORT)),
        init_method="env://",
    )
    started = start_rank(config, placement)
    gc_heap.freeze_startup_heap(f"pipeline rank {rank}", report_pauses=False)
    if started.subscriber is not None:
        return FollowerPipeline(started.runtime, started.subscriber)
    loop = build_loop(config, started.runtime, started.executor)
    return Pipeline(config, started.runtime, loop, all_rank_output=all_rank_output)


__all__ = ["FinishReason", "Pipeline", "Response", "pipeline"]
