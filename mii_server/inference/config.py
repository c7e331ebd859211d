"""InferenceConfig: ``init_inference``'s options under DeepSpeed's names, validated once.

The configuration comes as DeepSpeed takes it: a dict or the path of a JSON file as ``config``, plus
keyword arguments, merged shallowly with the keyword arguments taking precedence. Unknown keys raise
``UnknownArgument`` naming them (a DeepSpeed option this wrapper does not implement is named as such).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import InvalidRequest, UnknownArgument

# dtype spellings accepted beside torch dtypes (DeepSpeed's short names and torch's long ones)
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "int8": torch.int8,
}  # fmt: skip
_DTYPES = frozenset(_DTYPE_NAMES.values())

# DeepSpeedInferenceConfig keys that exist there but are not implemented here: named in the error
_DEEPSPEED_ONLY = frozenset({
    "base_dir", "checkpoint", "checkpoint_config", "config", "args", "enable_qkv_fusion", "ep_group",
    "ep_mp_group", "ep_size", "injection_dict", "injection_policy_tuple", "min_out_tokens", "moe",
    "moe_experts", "moe_type", "mpu", "quant", "replace_method", "return_tuple", "save_mp_checkpoint_path",
    "set_empty_params", "training_mp_size", "transposed_mode", "triangular_masking", "use_triton", "zero",
})  # fmt: skip


class TensorParallelConfig(BaseModel):
    """DeepSpeed's ``tensor_parallel`` section."""

    model_config = ConfigDict(extra="forbid")

    tp_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Ranks sharing one copy of the model: one process each (torchrun --nproc-per-node "
        "tp_size); torch.distributed is initialised when the script has not done it.",
    )


class InferenceConfig(BaseModel):
    """What ``init_inference`` does to a model, step by step (DeepSpeed's key names)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    dtype: torch.dtype | None = Field(
        default=None,
        description="Convert the model's floating-point weights to this dtype first: a torch dtype or "
        "'fp16' / 'bf16' / 'fp32' / 'int8' (weight-only int8 through mii_server's quantization). None "
        "keeps the model's own dtype (DeepSpeed converts to float16 by default; this wrapper does not).",
    )
    tensor_parallel: TensorParallelConfig = Field(
        default_factory=TensorParallelConfig, description="Tensor parallelism: {'tp_size': N}."
    )
    replace_with_kernel_inject: bool = Field(
        default=False,
        description="Swap the decoder layers of the families mii_server implements (llama, mistral, qwen2) "
        "for ours, running the fused kernels (RMSNorm with the residual add, rotary embedding with the KV "
        "append, paged attention) over their own KV cache; a family without kernels is an error.",
    )
    injection_policy: dict[Any, tuple[str, ...]] | None = Field(
        default=None,
        description="For tensor parallelism of models without an automatic plan: decoder layer class (or "
        "its class name) -> names, inside that layer, of the linear layers whose outputs are summed over "
        "the ranks (the output projections, e.g. ('self_attn.o_proj', 'mlp.down_proj')); every other "
        "linear layer of that class is split by output.",
    )
    enable_cuda_graph: bool = Field(
        default=False,
        description="Capture the kernel-injected decoder's one-token step as a CUDA graph per batch size "
        "(on first use) and replay it: needs CUDA, kernel injection and, with tensor parallelism, NCCL.",
    )
    keep_module_on_host: bool = Field(
        default=False, description="Leave the model on the CPU instead of moving it to this rank's GPU."
    )
    max_out_tokens: int = Field(
        default=1024,
        ge=1,
        description="Kernel-injected models: the most tokens (prompt plus generated, padding excluded) one "
        "sequence may hold in the KV cache, which is sized for it per batch row.",
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> torch.dtype | None:
        if value is None or isinstance(value, torch.dtype):
            if value is not None and value not in _DTYPES:
                raise ValueError(f"dtype {value} is not supported (float16, bfloat16, float32, int8)")
            return value
        if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPE_NAMES:
            return _DTYPE_NAMES[value.lower().removeprefix("torch.")]
        raise ValueError(f"dtype {value!r} is not one of {', '.join(sorted(_DTYPE_NAMES))} or a torch dtype")

    @field_validator("tensor_parallel", mode="before")
    @classmethod
    def _tp(cls, value: Any) -> Any:
        return {"tp_size": value} if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("injection_policy", mode="before")
    @classmethod
    def _policy(cls, value: Any) -> dict[Any, tuple[str, ...]] | None:
        # why ValueError for wrong types too: pydantic reports ValueError as a validation error
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("injection_policy must map a layer class (or its name) to linear layer names")  # noqa: TRY004
        policy: dict[Any, tuple[str, ...]] = {}
        for key, names in value.items():
            if not isinstance(key, (type, str)):
                raise ValueError(f"injection_policy key {key!r} is neither a class nor a class name")  # noqa: TRY004
            if isinstance(names, str):
                names = (names,)
            names = tuple(names) if isinstance(names, (list, tuple)) else ()
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"injection_policy[{key!r}] must name at least one linear layer")
            policy[key] = names
        return policy

    @model_validator(mode="before")
    @classmethod
    def _mp_size(cls, data: Any) -> Any:
        """``mp_size`` is the old name of ``tensor_parallel.tp_size``; ``max_tokens`` of max_out_tokens."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "max_tokens" in data:
            if "max_out_tokens" in data and data["max_out_tokens"] != data["max_tokens"]:
                raise ValueError("max_tokens (the old name of max_out_tokens) disagrees with max_out_tokens")
            data["max_out_tokens"] = data.pop("max_tokens")
        if "mp_size" in data:
            mp_size = data.pop("mp_size")
            tp = cls._tp(data.get("tensor_parallel", {}))
            tp = tp.model_dump() if isinstance(tp, TensorParallelConfig) else dict(tp)
            if "tp_size" in tp and tp["tp_size"] != mp_size:
                raise ValueError(f"mp_size={mp_size} disagrees with tensor_parallel.tp_size={tp['tp_size']}")
            data["tensor_parallel"] = {**tp, "tp_size": mp_size}
        return data

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel.tp_size

    @classmethod
    def resolve(
        cls, config: InferenceConfig | dict[str, Any] | str | Path | None, kwargs: dict[str, Any]
    ) -> InferenceConfig:
        """Merge ``config`` (a dict, a JSON file's path, an InferenceConfig or None) with ``kwargs``,
        which take precedence. ``UnknownArgument`` names unknown keys; bad values raise ``InvalidRequest``."""
        if isinstance(config, InferenceConfig):
            base = config.model_dump(exclude_unset=True)
        elif isinstance(config, (str, Path)):
            try:
                base = json.loads(Path(config).read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise InvalidRequest(f"cannot read the inference config {str(config)!r}: {err}") from None
            if not isinstance(base, dict):
                raise InvalidRequest(f"the inference config {str(config)!r} must hold a JSON object")
        elif config is None or isinstance(config, dict):
            base = dict(config or {})
        else:
            raise InvalidRequest(f"config must be a dict or a JSON file's path, not {type(config).__name__}")
        merged = {**base, **kwargs}
        known = set(cls.model_fields) | {"mp_size", "max_tokens"}
        unknown = sorted(set(merged) - known)
        if unknown:
            deepspeed = [k for k in unknown if k in _DEEPSPEED_ONLY]
            note = (
                f" ({', '.join(deepspeed)}: DeepSpeed options mii_server does not implement)"
                if deepspeed
                else ""
            )
            raise UnknownArgument(f"init_inference: unknown config key(s) {', '.join(unknown)}{note}")
        try:
            return cls.model_validate(merged)
        except ValidationError as err:
            raise InvalidRequest(f"invalid init_inference config: {err}") from None
