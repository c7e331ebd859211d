"""Model and engine configuration: one pydantic v2 tree, every field documented and constrained.

``ModelConfig.from_kwargs(model_name_or_path, **kwargs)`` is how ``pipeline()`` and ``serve()`` turn
user kwargs into a config: unknown names raise ``UnknownArgument`` before anything is loaded.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import InvalidRequest, UnknownArgument

DType = Literal["auto", "float32", "float16", "bfloat16"]
QuantizationMode = Literal["fp8", "int8", "wf6af16"]  # MII's quantization_mode values (wf6af16: FP6 weights)


def merge_mii_config_dicts(model_name_or_path: str, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Accept MII's ``model_config={...}`` and ``mii_config={...}`` dicts beside plain kwargs.

    Their keys join the kwargs (``mii_config`` may nest its own ``model_config``); the same key given
    twice with different values, or a model path that disagrees with the positional one, raises
    ``InvalidRequest``. Returns the model path and the flat kwargs.
    """
    kwargs = dict(kwargs)
    mii_config = dict(kwargs.pop("mii_config", None) or {})
    sources = [dict(mii_config.pop("model_config", None) or {}), mii_config, dict(kwargs.pop("model_config", None) or {})]
    for source in sources:
        path = source.pop("model_name_or_path", "") or source.pop("model", "")
        if path and model_name_or_path and path != model_name_or_path:
            raise InvalidRequest(f"model_name_or_path {model_name_or_path!r} disagrees with the config's {path!r}")
        model_name_or_path = model_name_or_path or path
        for key, value in source.items():
            if key in kwargs and kwargs[key] != value:
                raise InvalidRequest(f"{key} is given twice with different values ({kwargs[key]!r} and {value!r})")
            kwargs[key] = value
    return model_name_or_path, kwargs


class KVCacheConfig(BaseModel):
    """How the blocked KV cache is sized. Give ``num_blocks`` or ``memory_bytes``; neither means auto."""

    model_config = ConfigDict(extra="forbid")

    block_size: int = Field(default=64, ge=1, le=1024, description="Token slots per KV block.")
    dtype: Literal["auto", "fp8"] = Field(
        default="auto",
        description="Element type of the cached keys and values: auto is the model dtype; fp8 stores "
        "float8 e4m3 without scales (values past +-448 saturate), half of bf16's bytes for twice the "
        "blocks, read back into the model dtype by attention.",
    )
    num_blocks: int | None = Field(default=None, ge=1, description="Exact number of KV blocks to allocate.")
    memory_bytes: int | None = Field(
        default=None, ge=1, description="Bytes to spend on KV blocks (all layers, K and V)."
    )
    reserve_bytes: int = Field(
        default=1_000_000_000,
        ge=0,
        description="On CUDA with neither size given: bytes of free device memory left unallocated "
        "after the weights load (for activations, CUDA graphs and other processes).",
    )
    cpu_default_bytes: int = Field(
        default=256 * 2**20,
        ge=1,
        description="On the CPU with neither size given: bytes of host memory spent on KV blocks.",
    )

    @model_validator(mode="after")
    def _one_size(self) -> KVCacheConfig:
        if self.num_blocks is not None and self.memory_bytes is not None:
            raise ValueError("give kv_cache num_blocks or memory_bytes, not both")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"kv_cache block_size must be a power of two, not {self.block_size}")
        return self


class ModelConfig(BaseModel):
    """Everything needed to load one model and run its engine (per replica)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_name_or_path: str = Field(
        default="",
        description="Local checkpoint directory or Hugging Face hub id; empty means the built-in demo model.",
    )
    tokenizer: str | None = Field(default=None, description="Tokenizer path or id; None means the model's.")
    dtype: DType = Field(
        default="auto",
        description="Weight and activation dtype; auto is float32 on the CPU and, on a GPU, the checkpoint's "
        "float16 or bfloat16 (bfloat16 when it names neither).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Where the engine runs; auto picks CUDA when available."
    )
    tensor_parallel: int = Field(default=1, ge=1, le=64, description="Ranks that share one copy of the model.")
    quantization_mode: QuantizationMode | None = Field(
        default=None,
        description="Quantize the decoder's linear weights as they load (embedding and LM head keep the "
        "model dtype): fp8 (e4m3 weights per output channel, activations per token; needs fp8 tensor "
        "cores), int8 (weight-only, per output channel) or wf6af16 (MII's FP6 e3m2 weights, 16-bit "
        "activations). None loads the checkpoint as it is; fp8 checkpoints need no flag.",
    )
    max_length: int | None = Field(
        default=None,
        ge=1,
        description="Default most tokens of prompt plus output per request; None means the model's context.",
    )
    # why 8192, not MII's 768: measured through serve() on one H200 (bench/step_budget_sweep.py,
    # docs/BENCHMARKS.md 2026-12-02), 8192 gave 1.46x the output tok/s of 768 with 256 streams and a
    # lower TPOT p99 at 16 req/s (11.9 vs 15.3 ms): fewer, larger prefill steps interrupt decoding less
    max_ragged_batch_size: int = Field(
        default=8192,
        ge=1,
        description="Token budget of one forward pass, summed over all sequences (MII's default: 768).",
    )
    max_ragged_sequence_count: int = Field(
        default=512, ge=1, description="Most sequences in one forward pass."
    )
    max_tracked_sequences: int = Field(
        default=2048, ge=1, description="Most sequences the engine holds KV state for at once."
    )
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig, description="KV cache sizing.")
    seed: int = Field(default=0, ge=0, description="Seed for requests that bring none of their own.")
    cuda_graphs: bool = Field(
        default=True,
        description="On CUDA (Triton kernels): capture decode-only forwards as CUDA graphs at start-up "
        "for a ladder of batch sizes and replay them for steps without prompt tokens; under tensor "
        "parallelism every rank captures the same ladder with its NCCL collectives inside. Costs a few "
        "seconds of start-up and the graphs' memory pool (measured and kept out of the KV cache); False "
        "runs every step eagerly.",
    )
    overlap_scheduling: bool = Field(
        default=True,
        description="Queue each step before reading back the previous step's sampled tokens (they are "
        "fed to the model on the device; under tensor parallelism rank 0 broadcasts them to the other "
        "ranks on the device), so scheduling and request bookkeeping run while the device computes. "
        "A request that stops early costs one discarded token of compute. False waits for every "
        "step's tokens before building the next.",
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description="Share full KV blocks between requests by content: a prompt that starts like an "
        "earlier one (a system prompt, a chat history, few-shot examples) reuses the cached blocks of "
        "that prefix and computes only the rest. Unused cached blocks are evicted least recently used, "
        "only when the cache needs room. False computes every prompt in full.",
    )
    cuda_graph_max_batch: int = Field(
        default=512,
        ge=1,
        le=1024,
        description="Largest decode batch (sequences) captured as a CUDA graph; larger decode steps run "
        "eagerly. Capped by max_ragged_sequence_count.",
    )

    @model_validator(mode="after")
    def _limits_agree(self) -> ModelConfig:
        if self.max_ragged_sequence_count > self.max_ragged_batch_size:
            raise ValueError("max_ragged_sequence_count must not exceed max_ragged_batch_size")
        if self.max_ragged_sequence_count > self.max_tracked_sequences:
            raise ValueError("max_ragged_sequence_count must not exceed max_tracked_sequences")
        return self

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(cls.model_fields)

    @classmethod
    def from_kwargs(cls, model_name_or_path: str = "", **kwargs: Any) -> ModelConfig:
        """Build from user kwargs: ``UnknownArgument`` for unknown names, ``InvalidRequest`` for bad values."""
        model_name_or_path, kwargs = merge_mii_config_dicts(model_name_or_path, kwargs)
        unknown = sorted(set(kwargs) - cls.field_names())
        if unknown:
            raise UnknownArgument(f"Keyword argument(s) {', '.join(unknown)} not recognized")
        try:
            return cls.model_validate({"model_name_or_path": model_name_or_path, **kwargs})
        except ValidationError as err:
            raise InvalidRequest(f"invalid model configuration: {err}") from None
