"""Variants we cannot run are refused at load with UnsupportedModel naming what is missing."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from mii_server.errors import UnsupportedModel
from mii_server.models import load_model

SMALL = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}

# (model_type, config overrides, what the error must name)
CASES = [
    ("opt", {"do_layer_norm_before": False}, "do_layer_norm_before=False"),
    ("opt", {"word_embed_proj_dim": 16}, "word_embed_proj_dim"),
    ("falcon", {"alibi": True}, "ALiBi"),
    ("falcon", {"new_decoder_architecture": True, "parallel_attn": False}, "parallel_attn=False"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("phi3", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                               "original_max_position_embeddings": 64}}, "longrope"),
    ("llama", {"hidden_act": "gelu"}, "activation 'gelu'"),
    ("mixtral", {"hidden_act": "gelu_pytorch_tanh"}, "experts with activation"),
]


def _config_only(path: Path, model_type: str, overrides: dict[str, Any]) -> Path:
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **SMALL, **overrides).save_pretrained(str(path))
    return path


@pytest.mark.parametrize(("model_type", "overrides", "named"), CASES)
def test_unsupported_variant_is_refused(
    model_type: str, overrides: dict[str, Any], named: str, tmp_path: Path
) -> None:
    path = _config_only(tmp_path, model_type, overrides)
    with pytest.raises(UnsupportedModel, match=re.escape(named)):
        load_model(path, "float32", torch.device("cpu"))
