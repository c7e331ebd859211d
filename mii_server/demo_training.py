"""Train the built-in demo model: a small Llama that writes English, from CPython's own documentation.

Corpus, offline and openly licensed: the help topics CPython ships in ``pydoc_data.topics`` (the
Language Reference's chapters, as ``help("lists")`` shows them) and the docstrings of the standard
library's modules, classes and functions, read from the running Python's ``Lib`` folder with ``ast``
(nothing is imported). Both are part of CPython, under the PSF License Version 2 (the docs' code
examples also under Zero-Clause BSD); that license is copied next to the weights as
``DATA_LICENSE.txt`` and asks that its copyright notice be retained in derived works.

A byte-level BPE tokenizer (``tokenizers``) is trained on the corpus; then a Llama of our own family
(``DEMO_SHAPE``: 4 layers, hidden 256, tied embeddings, about 3.4M parameters) learns next-token
prediction with AdamW. Every ``--eval-every`` steps the loss on held-out documents (every 20th) is
measured and the best weights are kept (the corpus is small: the model would memorise it given
time). The output folder holds ``config.json``, ``model.safetensors`` (bfloat16, about 7 MB), the
tokenizer files, ``generation_config.json``, ``DATA_LICENSE.txt`` and ``training.json`` (corpus
hash, settings, losses, samples).

    python -m mii_server.demo_training --out mii_server/demo_weights              # one GPU, ~2 min
    python -m mii_server.demo_training --out /tmp/demo --device cpu --steps 3 --tiny  # smoke test
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import logging
import math
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# a Llama of our family; head_dim 64 (every kernel supports it), 2 KV heads (GQA). Its rotary positions
# reach 2048, beyond the 512-token training windows: requests may run that long (the servers' own tests
# stream 2,000 tokens), while text past ~512 tokens loses the coherence the windows taught it
DEMO_SHAPE: dict[str, Any] = {
    "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "attention_dropout": 0.1,
}  # fmt: skip
TINY_SHAPE: dict[str, Any] = {**DEMO_SHAPE, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                              "num_hidden_layers": 2, "max_position_embeddings": 128}  # fmt: skip
SAMPLE_PROMPTS = ["The list of", "A function is", "To open a file,"]
# stdlib folders that hold tests, demos or generated tables rather than documentation
SKIPPED_PARTS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3", "ensurepip", "turtledemo",
     "pydoc_data", "encodings", "__pycache__"}
)  # fmt: skip


def corpus_documents(max_chars: int | None = None) -> list[str]:
    """The training text, one string per document, in a fixed order: the pydoc topics, then every
    docstring of 80 characters or more in the standard library. ``max_chars`` stops early."""
    from pydoc_data.topics import topics

    docs = [topics[name].strip() for name in sorted(topics)]
    total = sum(map(len, docs))
    if max_chars is None or total < max_chars:
        for doc in stdlib_docstrings():
            docs.append(doc)
            total += len(doc)
            if max_chars is not None and total >= max_chars:
                break
    return docs


def stdlib_docstrings() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if SKIPPED_PARTS & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 80:
                    yield doc.strip()


def corpus_license() -> Path:
    """The license file of the Python installation the corpus comes from."""
    return Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


@dataclass
class TrainingSettings:
    """Knobs of one training run (recorded in training.json)."""

    steps: int = 1500
    batch: int = 32  # sequences per step
    context: int = 512  # tokens per training window
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    eval_every: int = 50
    eval_batches: int = 16
    seed: int = 0
    shape: dict[str, Any] = field(default_factory=lambda: dict(DEMO_SHAPE))


def token_streams(tokenizer: Any, docs: list[str]) -> tuple[Any, Any]:
    """(train, validation) int64 token streams; each document ends with EOS; every 20th is held out."""
    import torch

    train: list[int] = []
    val: list[int] = []
    eos = tokenizer.eos_token_id
    for i, ids in enumerate(tokenizer(docs, add_special_tokens=False)["input_ids"]):
        (val if i % 20 == 19 else train).extend([*ids, eos])
    return torch.tensor(train, dtype=torch.int64), torch.tensor(val, dtype=torch.int64)


def batch_of(stream: Any, batch: int, context: int, generator: Any) -> Any:
    """``batch`` random windows of ``context + 1`` tokens: [batch, context + 1]."""
    import torch

    starts = torch.randint(0, len(stream) - context - 1, (batch,), generator=generator)
    return torch.stack([stream[s : s + context + 1] for s in starts.tolist()])


def train(out: Path, settings: TrainingSettings, device: str, max_chars: int | None = None) -> dict[str, Any]:
    """Train the tokenizer and the model, write the demo checkpoint into ``out``; returns the record
    written as training.json."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from .demo_model import train_tokenizer

    started = time.time()
    torch.manual_seed(settings.seed)
    docs = corpus_documents(max_chars)
    text_hash = hashlib.sha256("\x00".join(docs).encode()).hexdigest()
    log.info(
        "corpus: %d documents, %d characters (sha256 %s)", len(docs), sum(map(len, docs)), text_hash[:12]
    )
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out, vocab_size=settings.shape["vocab_size"], texts=docs)
    train_ids, val_ids = token_streams(tokenizer, docs)
    context = min(settings.context, settings.shape["max_position_embeddings"])
    log.info("tokens: %d train, %d validation", len(train_ids), len(val_ids))

    config = LlamaConfig(
        **settings.shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr, betas=(0.9, 0.95), fused=device.startswith("cuda"),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(settings.seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))

    def loss_of(tokens: Any) -> Any:
        tokens = tokens.to(device, non_blocking=True)
        with autocast:
            logits = model(tokens[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    def lr_at(step: int) -> float:  # linear warm-up, then cosine down to a tenth
        if step < settings.warmup:
            return settings.lr * (step + 1) / settings.warmup
        progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
        return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def validation_loss() -> float:
        model.eval()
        val_gen = torch.Generator().manual_seed(12345)  # the same windows at every evaluation
        with torch.no_grad():
            losses = [loss_of(batch_of(val_ids, settings.batch, context, val_gen)).item()
                      for _ in range(settings.eval_batches)]  # fmt: skip
        model.train()
        return sum(losses) / len(losses)

    best = (math.inf, -1, copy.deepcopy(model.state_dict()))
    history = []
    model.train()
    for step in range(settings.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = loss_of(batch_of(train_ids, settings.batch, context, generator))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            val = validation_loss()
            history.append({"step": step + 1, "train_loss": round(loss.item(), 4), "val_loss": round(val, 4)})
            log.info("step %d: train loss %.3f, validation loss %.3f", step + 1, loss.item(), val)
            if val < best[0]:
                best = (val, step + 1, copy.deepcopy(model.state_dict()))
    model.load_state_dict(best[2])
    model.config.attention_dropout = 0.0  # (inference: no dropout)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    model.generation_config.save_pretrained(str(out))
    shutil.copyfile(corpus_license(), out / "DATA_LICENSE.txt")
    record = {
        "model": "Llama (mii-server demo)", "parameters": params, "best_step": best[1],
        "best_val_loss": round(best[0], 4), "history": history, "settings": asdict(settings),
        "corpus": {"source": "CPython pydoc_data.topics + standard-library docstrings (PSF License Version 2)",
                   "python": sys.version.split()[0], "documents": len(docs), "characters": sum(map(len, docs)),
                   "train_tokens": len(train_ids), "val_tokens": len(val_ids), "sha256": text_hash},
        "device": device, "torch": torch.__version__, "seconds": round(time.time() - started, 1),
    }  # fmt: skip
    record["samples"] = samples(out, device)
    (out / "training.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return record


def samples(out: Path, device: str) -> dict[str, str]:
    """What the written checkpoint says, through our own engine, to each of SAMPLE_PROMPTS."""
    from .in_process import pipeline

    pipe = pipeline(str(out), device="cpu" if device == "cpu" else "cuda", kv_cache={"num_blocks": 64})
    try:
        responses = pipe(
            SAMPLE_PROMPTS, max_new_tokens=40, do_sample=True, temperature=0.7, top_p=0.9, seed=0
        )
        return {p: r.generated_text for p, r in zip(SAMPLE_PROMPTS, responses)}
    finally:
        pipe.destroy()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder to write the checkpoint into")
    ap.add_argument("--device", default="cuda", help="torch device to train on")
    ap.add_argument("--steps", type=int, default=TrainingSettings.steps)
    ap.add_argument("--batch", type=int, default=TrainingSettings.batch)
    ap.add_argument("--lr", type=float, default=TrainingSettings.lr)
    ap.add_argument("--eval-every", type=int, default=TrainingSettings.eval_every)
    ap.add_argument(
        "--max-chars", type=int, default=None, help="use only the first this many corpus characters"
    )
    ap.add_argument("--tiny", action="store_true", help="a tiny model on part of the corpus (smoke test)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    settings = TrainingSettings(steps=args.steps, batch=args.batch, lr=args.lr, eval_every=args.eval_every)
    if args.tiny:
        settings.shape, settings.batch, settings.eval_batches = dict(TINY_SHAPE), 4, 2
        args.max_chars = args.max_chars or 60_000
    record = train(args.out, settings, args.device, args.max_chars)
    print(json.dumps({k: record[k] for k in ("parameters", "best_step", "best_val_loss", "seconds", "samples")},
                     indent=1, ensure_ascii=False))  # fmt: skip


if __name__ == "__main__":
    main()
