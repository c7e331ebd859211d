"""Which class implements which ``model_type``."""

from __future__ import annotations

from ..errors import UnsupportedModel
from .falcon import FalconForCausalLM
from .gemma2 import Gemma2ForCausalLM
from .llama import LlamaForCausalLM
from .mistral import MistralForCausalLM
from .mixtral import MixtralForCausalLM
from .opt import OPTForCausalLM
from .phi import PhiForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen2_moe import Qwen2MoeForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

MODEL_FAMILIES: dict[str, type[LlamaForCausalLM]] = {
    "falcon": FalconForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "mixtral": MixtralForCausalLM,
    "opt": OPTForCausalLM,
    "phi": PhiForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def model_class_for(model_type: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_FAMILIES[model_type]
    except KeyError:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(MODEL_FAMILIES))}"
        ) from None
