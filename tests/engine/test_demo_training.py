"""The demo-model training script runs (CPU, a few steps of a tiny model on part of the corpus) and
writes a checkpoint our engine serves; once such files sit in the package's demo folder, a pipeline
with no model loads them instead of the random demo model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mii_server
from mii_server import demo_model, demo_training, runtime
from mii_server.config import ModelConfig
from mii_server.runtime import model_path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    settings = demo_training.TrainingSettings(steps=2, batch=2, context=32, eval_every=1, eval_batches=1)
    settings.shape = dict(demo_training.TINY_SHAPE)
    demo_training.train(out, settings, "cpu", max_chars=20_000)
    return out


def test_training_writes_a_servable_checkpoint_with_its_data_license(trained: Path) -> None:
    names = {p.name for p in trained.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
            "DATA_LICENSE.txt", "training.json"} <= names  # fmt: skip
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in (trained / "DATA_LICENSE.txt").read_text()
    record = json.loads((trained / "training.json").read_text())
    assert record["best_step"] in (1, 2) and len(record["history"]) == 2
    assert record["corpus"]["documents"] > 10 and len(record["corpus"]["sha256"]) == 64
    assert set(record["samples"]) == set(demo_training.SAMPLE_PROMPTS)
    config = json.loads((trained / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] and config["vocab_size"] == 512


def test_corpus_is_cpython_documentation() -> None:
    docs = demo_training.corpus_documents(max_chars=1)
    assert len(docs) > 50 and any(d.startswith("List displays") for d in docs)  # pydoc topics
    assert len(next(demo_training.stdlib_docstrings())) >= 80


def test_no_model_means_the_packaged_demo_once_it_exists(trained: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(demo_model, "PACKAGED_DEMO_DIR", tmp_path / "demo_weights")  # none shipped
    random_demo = tmp_path / "random-demo"  # (stands for the random model, not built here)
    monkeypatch.setattr(runtime, "demo_model_path", lambda: random_demo)
    assert model_path(ModelConfig()) == random_demo
    monkeypatch.setattr(demo_model, "PACKAGED_DEMO_DIR", trained)
    assert model_path(ModelConfig()) == trained
    pipe = mii_server.pipeline()
    assert pipe.runtime.loaded.path == trained
    assert pipe("The list of", max_new_tokens=4, do_sample=False)[0].generated_length == 4
    pipe.destroy()
