"""Which class implements which ``model_type``."""

from __future__ import annotations

from ..errors import UnsupportedModel
from .llama import LlamaForCausalLM
from .mistral import MistralForCausalLM
from .qwen2 import Qwen2ForCausalLM

MODEL_FAMILIES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
}


def model_class_for(model_type: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_FAMILIES[model_type]
    except KeyError:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(MODEL_FAMILIES))}"
        ) from None
