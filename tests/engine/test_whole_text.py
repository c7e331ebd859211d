"""Text decoded once at the end (non-streamed requests) equals the streamed chunks joined."""

from __future__ import annotations

from pathlib import Path

import pytest

from mii_server.batching.loop import GenerationLoop
from mii_server.batching.request import RequestUpdate
from mii_server.config import ModelConfig
from mii_server.generation.params import GenerateParams
from mii_server.runtime import build_loop, build_runtime

PROMPTS = ["Multilingual text: café, 東京, 🙂", "The quick brown fox", "Numbers 0 1 2"]


@pytest.fixture(scope="module")
def loop(tiny_checkpoints: dict[str, Path]) -> GenerationLoop:
    config = ModelConfig(model_name_or_path=str(tiny_checkpoints["llama"]))
    return build_loop(config, build_runtime(config))


def run(loop: GenerationLoop, stream: bool, **kwargs: object) -> list[list[RequestUpdate]]:
    params = GenerateParams.from_kwargs(do_sample=False, **kwargs)
    updates: dict[int, list[RequestUpdate]] = {}
    uids = [loop.submit(p, params, lambda u: updates.setdefault(u.uid, []).append(u), stream) for p in PROMPTS]
    while loop.has_work():
        loop.step()
    return [updates[uid] for uid in uids]


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 40, "ignore_eos": True}, {"max_new_tokens": 40, "stop": ["e"]}])
def test_whole_text_equals_streamed_text(loop: GenerationLoop, kwargs: dict) -> None:
    streamed, whole = run(loop, True, **kwargs), run(loop, False, **kwargs)
    for s, w in zip(streamed, whole):
        assert [u.response.token_ids for u in s] == [u.response.token_ids for u in w]
        assert "".join(u.response.generated_text for u in s) == "".join(u.response.generated_text for u in w)
        assert w[-1].response.finish_reason == s[-1].response.finish_reason
        if "stop" not in kwargs:  # without stop strings, nothing is decoded before the end
            assert all(u.response.generated_text == "" for u in w[:-1])
