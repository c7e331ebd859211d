"""A hub id resolves through the Hugging Face cache, with no network."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import mii_server
from mii_server.errors import InvalidRequest
from mii_server.models import resolve_model_path


def use_hub_cache(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """Point huggingface_hub at ``cache``, offline (it reads its environment once, at import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_hub_id_resolves_from_the_cache(tiny_checkpoints: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    shutil.copytree(tiny_checkpoints["llama"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    use_hub_cache(monkeypatch, tmp_path / "hub")
    assert resolve_model_path("tiny-org/tiny-llama") == repo / "snapshots" / commit
    pipe = mii_server.pipeline("tiny-org/tiny-llama")
    direct = mii_server.pipeline(str(tiny_checkpoints["llama"]))
    kwargs = {"max_new_tokens": 8, "do_sample": False, "ignore_eos": True}
    assert pipe(["Hello"], **kwargs)[0].token_ids == direct(["Hello"], **kwargs)[0].token_ids


def test_unknown_model_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    use_hub_cache(monkeypatch, tmp_path / "empty-hub")
    with pytest.raises(InvalidRequest, match="neither a local directory nor a model"):
        resolve_model_path("nobody/no-such-model")
