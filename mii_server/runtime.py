"""Build a ready GenerationLoop from a ModelConfig: device, weights, tokenizer, KV cache, engine."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .batching.executor import LocalExecutor, StepExecutor
from .batching.loop import GenerationLoop
from .config import KVCacheConfig, ModelConfig
from .demo_model import demo_model_path, packaged_demo_path
from .engine import BlockedAllocator, BlockedKVCache, InferenceEngine, PrefixCache, StateManager
from .errors import InvalidRequest
from .models import LoadedModel, load_model, resolve_model_path
from .models.parallel import TensorParallelGroup

log = logging.getLogger(__name__)


def pick_device(config: ModelConfig, local_rank: int = 0) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise InvalidRequest("device='cuda' was asked for, but no CUDA device is available")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def model_path(config: ModelConfig) -> Path:
    """The checkpoint to load; no model named: the trained demo model when the package ships it,
    else the random-weight one (built on first use)."""
    if not config.model_name_or_path:
        return packaged_demo_path() or demo_model_path()
    return resolve_model_path(config.model_name_or_path)


def kv_cache_dtype(cfg: KVCacheConfig, loaded: LoadedModel) -> torch.dtype:
    return torch.float8_e4m3fn if cfg.dtype == "fp8" else loaded.dtype


def num_kv_blocks(
    cfg: KVCacheConfig, loaded: LoadedModel, kv_heads_per_rank: int, working_bytes: int = 0
) -> int:
    """KV blocks for this rank: given, from a byte budget, or from free memory less the reserve and
    ``working_bytes`` (measured activations and CUDA-graph pools)."""
    spec = loaded.spec
    per_block = BlockedKVCache.bytes_per_block(
        spec.num_layers, cfg.block_size, kv_heads_per_rank, spec.head_dim, kv_cache_dtype(cfg, loaded)
    )
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    if cfg.memory_bytes is not None:
        budget = cfg.memory_bytes
    elif loaded.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(loaded.device)
        budget = free - cfg.reserve_bytes - working_bytes
    else:
        budget = cfg.cpu_default_bytes
    blocks = budget // per_block
    if blocks < 1:
        raise InvalidRequest(
            f"no room for a single KV block ({per_block} bytes) in {budget} bytes; lower "
            "kv_cache.reserve_bytes or block_size, or give memory_bytes"
        )
    return blocks


def working_memory_bytes(config: ModelConfig, loaded: LoadedModel, kv_heads: int, graphs: bool) -> int:
    """Device memory the forwards need beside the weights and the KV cache, measured before the cache
    is sized: the largest eager step's activations and, with graphs, the graphs' pool plus the
    transient warm-up of the largest rung (the larger of the two transients is what counts)."""
    from .engine.cuda_graphs import forward_peak_bytes, graph_batch_sizes

    spec = loaded.spec
    scratch = BlockedKVCache(spec.num_layers, 1, config.kv_cache.block_size, kv_heads, spec.head_dim,
                             kv_cache_dtype(config.kv_cache, loaded), loaded.device)  # fmt: skip
    eager = forward_peak_bytes(
        loaded.model, scratch, config.max_ragged_batch_size, config.max_ragged_sequence_count
    )
    graph = pool = 0
    if graphs:
        sizes = graph_batch_sizes(config.max_ragged_sequence_count, config.cuda_graph_max_batch)
        graph = forward_peak_bytes(loaded.model, scratch, sizes[-1], sizes[-1])
        # every rung keeps its own float32 logits in the shared pool (measured on the H200: 24 rungs
        # of a 128k vocabulary took 1998 MiB, where one forward's peak is 391 MiB)
        pool = graph + sum(sizes) * spec.vocab_size * 4
    del scratch
    torch.cuda.empty_cache()
    log.info("working memory: %d MiB eager, %d MiB graph pool", eager >> 20, pool >> 20)
    return pool + max(graph, eager)


def use_cuda_graphs(config: ModelConfig, device: torch.device) -> bool:
    """Decode CUDA graphs need CUDA and the Triton kernels (the reference attention reads lengths back
    to the host, which a graph cannot). Under tensor parallelism on CUDA the group is NCCL's
    (``init_tensor_parallel``), whose collectives are captured with the rest of the forward."""
    from .kernels import get_ops, reference

    return config.cuda_graphs and device.type == "cuda" and get_ops(device) is not reference


@dataclass
class Runtime:
    """Everything one rank holds: the loaded model, its engine, the tokenizer, and the group of
    tensor-parallel ranks it belongs to."""

    loaded: LoadedModel
    engine: InferenceEngine
    tokenizer: Any
    tp: TensorParallelGroup

    @property
    def context_length(self) -> int:
        return self.loaded.spec.max_positions


def build_runtime(
    config: ModelConfig, tp: TensorParallelGroup | None = None, device: torch.device | None = None
) -> Runtime:
    """Load the model shard of ``tp``'s rank and size its KV cache (tensor-parallel ranks agree on
    the smallest block count any of them can hold)."""
    from transformers import AutoTokenizer

    tp = tp or TensorParallelGroup()
    device = device or pick_device(config, tp.rank)
    path = model_path(config)
    loaded = load_model(path, config.dtype, device, tp, config.quantization_mode)
    kv_heads = loaded.model.layers[0].self_attn.num_kv_heads
    spec = loaded.spec
    graphs = use_cuda_graphs(config, device)
    working = working_memory_bytes(config, loaded, kv_heads, graphs) if device.type == "cuda" else 0
    blocks = tp.agree_min(num_kv_blocks(config.kv_cache, loaded, kv_heads, working))
    kv_cache = BlockedKVCache(
        spec.num_layers, blocks, config.kv_cache.block_size, kv_heads, spec.head_dim,
        kv_cache_dtype(config.kv_cache, loaded), device,
    )  # fmt: skip
    allocator = PrefixCache(blocks) if config.enable_prefix_caching else BlockedAllocator(blocks)
    state = StateManager(allocator, config.kv_cache.block_size, config.max_tracked_sequences)
    engine = InferenceEngine(
        loaded.model, kv_cache, state, config.max_ragged_batch_size, config.max_ragged_sequence_count
    )
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or str(path))
    log.info("KV cache: %d blocks of %d tokens", blocks, config.kv_cache.block_size)
    if graphs:
        # why after the KV cache: graphs bake in the cache's addresses; their pool was counted in the
        # working memory the KV sizing above left free
        max_context = min(spec.max_positions, blocks * config.kv_cache.block_size)
        captured = engine.capture_cuda_graphs(max_context, config.cuda_graph_max_batch)
        free, _ = torch.cuda.mem_get_info(device)
        log.info(
            "CUDA graphs took %d MiB; %d MiB of device memory left free",
            captured.pool_bytes >> 20,
            free >> 20,
        )
    return Runtime(loaded=loaded, engine=engine, tokenizer=tokenizer, tp=tp)


def eos_token_ids(runtime: Runtime) -> frozenset[int]:
    ids = set(runtime.loaded.spec.eos_token_ids)
    if runtime.tokenizer.eos_token_id is not None:
        ids.add(runtime.tokenizer.eos_token_id)
    gen_config = runtime.loaded.path / "generation_config.json"
    if gen_config.exists():
        import json

        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


def build_loop(config: ModelConfig, runtime: Runtime, executor: StepExecutor | None = None) -> GenerationLoop:
    context = runtime.context_length
    return GenerationLoop(
        executor or LocalExecutor(runtime.engine),
        runtime.tokenizer,
        eos_token_ids(runtime),
        context_length=context,
        default_max_length=min(config.max_length or context, context),
        max_batch_tokens=config.max_ragged_batch_size,
        max_batch_sequences=config.max_ragged_sequence_count,
        max_tracked_sequences=config.max_tracked_sequences,
        seed=config.seed,
        overlap=config.overlap_scheduling,
        vocab_size=runtime.loaded.spec.vocab_size,
    )
