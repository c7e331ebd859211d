"""The built-in demo model, and the tiny checkpoints tests and benchmarks build.

No hub is needed: a byte-level BPE tokenizer is trained with the ``tokenizers`` library on a fixed
text, and a small decoder gets seeded random weights saved as safetensors. The same inputs give the
same files on every machine. The demo model's output is not meaningful text: it exists so a newcomer
can stand a server up and send a request before downloading a real model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEMO_MODEL_NAME = "mii-server-demo-llama-v1"
# The trained demo model, shipped as package data once it exists (see mii_server/demo_training.py).
PACKAGED_DEMO_DIR = Path(__file__).with_name("demo_weights")

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A model server answers requests for text.
Large language models predict the next token; a tokenizer turns text into tokens and back.
Ragged batching packs many sequences into one forward pass; a blocked KV cache holds their keys.
Deployments have replicas, a load balancer and a REST gateway. Clients stream tokens as they come.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, punctuation ,.;:!?'"()[]{}-_/\\ and symbols @#$%^&*+=<>|~`.
Multilingual text: café, naïve, façade, Grüße, 東京, 日本語, 中文, 한국어, Ελληνικά, русский, emoji 🙂🚀.
"""

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]


def cache_root() -> Path:
    return Path(os.environ.get("MII_SERVER_CACHE", Path.home() / ".cache" / "mii_server"))


def train_tokenizer(out_dir: Path, vocab_size: int = 384, texts: Iterable[str] | None = None) -> Any:
    """Train and save a byte-level BPE tokenizer (deterministic) on ``texts`` (default: the fixed
    corpus of the tiny test models); returns the HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4 if texts is None else texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_checkpoint(out_dir: Path, model_type: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random-weight checkpoint of ``model_type`` (llama, mistral, qwen2) with a tokenizer.

    ``overrides`` go to the transformers config (e.g. num_key_value_heads, rope_scaling).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out_dir)
    settings: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
    }
    settings.update(overrides)
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # larger weights than the default init: less tied logits
            p.normal_(0.0, 0.2)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def packaged_demo_path() -> Path | None:
    """The trained demo checkpoint shipped in the package (``PACKAGED_DEMO_DIR``), or None when the
    package ships none (then the random demo model of ``demo_model_path`` stands in)."""
    folder = PACKAGED_DEMO_DIR
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    return None


def demo_model_path() -> Path:
    """The demo checkpoint's directory, built on first use (safe when several processes race)."""
    target = cache_root() / DEMO_MODEL_NAME
    if (target / "config.json").exists():
        return target
    log.warning("building the built-in DEMO model (tiny, random weights: its text is gibberish) in %s", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        build_tiny_checkpoint(staging, "llama", seed=1234, max_position_embeddings=2048)
        (staging / "mii_server_demo.json").write_text(json.dumps({"demo": True}))
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is identical
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
