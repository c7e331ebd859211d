"""Stopping: stop strings across token boundaries (with streaming hold-back), EOS, stop_token_ids,
min_new_tokens and ignore_eos."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import mii_server
from mii_server.batching.request import RequestUpdate
from mii_server.generation.params import GenerateParams
from mii_server.generation.stopping import StopStringMatcher
from mii_server.in_process import Pipeline

NEW_TOKENS = 24
PROMPT = "A model server answers"
EOS_PROMPT = "Hello"

# ---- the matcher alone ------------------------------------------------------------------------


def feed_all(stops: list[str], chunks: list[str]) -> tuple[list[str], bool]:
    matcher = StopStringMatcher(stops)
    out = [matcher.feed(c) for c in chunks]
    return out + [matcher.flush()], matcher.matched


def test_matcher_holds_back_possible_stop_prefixes() -> None:
    out, matched = feed_all(["STOP"], ["abcS", "T", "A", "ST", "OP and more", "ignored"])
    assert out == ["abc", "", "STA", "", "", "", ""]
    assert matched


def test_matcher_stop_spanning_many_chunks() -> None:
    out, matched = feed_all(["xyz"], ["a", "x", "y", "z", "b"])
    assert out == ["a", "", "", "", "", ""] and matched


def test_matcher_earliest_stop_wins_whatever_the_list_order() -> None:
    out, matched = feed_all(["cde", "bcd"], ["ab", "cdef"])
    assert "".join(out) == "a" and matched


def test_matcher_overlapping_prefix() -> None:
    out, matched = feed_all(["aab"], ["a", "a", "a", "b"])
    assert out == ["", "", "a", "", ""] and matched


def test_matcher_releases_held_text_on_flush() -> None:
    out, matched = feed_all(["STOP"], ["done ST"])
    assert out == ["done ", "ST"] and not matched


def test_matcher_without_stops_releases_everything() -> None:
    out, matched = feed_all([], ["a", "b"])
    assert out == ["a", "b", ""] and not matched


# ---- through the pipeline ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipe(tiny_checkpoints: dict[str, Path]) -> Pipeline:
    return mii_server.pipeline(str(tiny_checkpoints["llama"]), kv_cache={"block_size": 16, "num_blocks": 64})


@pytest.fixture(scope="module")
def base(pipe: Pipeline) -> tuple[list[int], str, list[str]]:
    """Greedy ids, text and per-token pieces of PROMPT with no stopping but length."""
    r = pipe(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False, ignore_eos=True)[0]
    return r.token_ids, r.generated_text, [pipe.tokenizer.decode([t]) for t in r.token_ids]


def multi_token_stop(pieces: list[str]) -> tuple[int, str]:
    """A stop string from the middle of token i to the middle of token i + 2 (clean text only)."""
    for i in range(len(pieces) - 2):
        a, b, c = pieces[i : i + 3]
        if len(a) >= 2 and b and c and "\ufffd" not in a + b + c:
            return i, a[1:] + b + c[:1]
    raise AssertionError(f"no clean three-token window in {pieces}")


def greedy(pipe: Pipeline, prompt: str = PROMPT, **kwargs: object) -> mii_server.Response:
    settings: dict[str, object] = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "ignore_eos": True}
    return pipe(prompt, **{**settings, **kwargs})[0]


def test_stop_string_across_token_boundaries(pipe: Pipeline, base: tuple[list[int], str, list[str]]) -> None:
    ids, text, pieces = base
    i, stop = multi_token_stop(pieces)
    cut = text.find(stop)
    assert cut == len("".join(pieces[:i])) + 1  # the first occurrence is the one built from tokens i..i+2
    r = greedy(pipe, stop=stop)
    assert r.generated_text == text[:cut]
    assert r.finish_reason == "stop"
    assert r.token_ids == ids[: i + 3]  # generation ended on the token that completed the stop string
    assert r.generated_length == i + 3


def test_several_stop_strings(pipe: Pipeline, base: tuple[list[int], str, list[str]]) -> None:
    ids, text, pieces = base
    i, early = multi_token_stop(pieces)
    late = next(  # clean text of two later tokens that first occurs after `early`
        a + b
        for a, b in zip(pieces[i + 3 :], pieces[i + 4 :])
        if a and b and "\ufffd" not in a + b and text.find(a + b) > text.find(early)
    )
    assert 0 < text.find(early) < text.find(late)
    r = greedy(pipe, stop=[late, "\u00a7never\u00a7", early])
    assert r.generated_text == text[: text.find(early)] and r.finish_reason == "stop"
    r = greedy(pipe, stop=[late, "\u00a7never\u00a7"])
    assert r.generated_text == text[: text.find(late)] and r.finish_reason == "stop"
    r = greedy(pipe, stop=["\u00a7never\u00a7"])
    assert r.generated_text == text and r.token_ids == ids and r.finish_reason == "length"


def test_streaming_hold_back(pipe: Pipeline, base: tuple[list[int], str, list[str]]) -> None:
    _, text, pieces = base
    _, stop = multi_token_stop(pieces)
    loop = pipe.loop
    assert loop is not None
    updates: list[RequestUpdate] = []
    loop.submit(
        PROMPT, GenerateParams(max_new_tokens=NEW_TOKENS, do_sample=False, stop=[stop]), updates.append
    )
    while loop.has_work():
        loop.step()
    chunks = [u.response.generated_text for u in updates]
    released = ""
    for chunk in chunks:
        released += chunk
        assert stop not in released
    assert released == text[: text.find(stop)]
    assert [u.finished for u in updates] == [False] * (len(updates) - 1) + [True]
    assert updates[-1].response.finish_reason == "stop"
    # The matcher held text back: some update released less than its token decodes to.
    assert any(u.response.token_ids and u.response.generated_text == "" for u in updates[:-1])


def test_stop_token_ids(pipe: Pipeline, base: tuple[list[int], str, list[str]]) -> None:
    ids, _, _ = base
    k = next(k for k in range(3, len(ids)) if ids[k] not in ids[:k])
    r = greedy(pipe, stop_token_ids=[ids[k]])
    assert r.token_ids == ids[: k + 1] and r.finish_reason == "stop"
    assert r.generated_text == greedy(pipe, max_new_tokens=k).generated_text  # the stop id adds no text


# ---- EOS: a copy of the checkpoint whose generation_config names a token greedy decoding emits -------


@pytest.fixture(scope="module")
def eos_setup(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, pipe: Pipeline
) -> tuple[Pipeline, list[int], int]:
    """(pipeline whose EOS includes ids[k], greedy ids of EOS_PROMPT without EOS, k)."""
    ids = greedy(pipe, EOS_PROMPT).token_ids
    k = next(k for k in range(3, len(ids)) if ids[k] not in ids[:k])
    path = tmp_path_factory.mktemp("eos") / "llama"
    shutil.copytree(tiny_checkpoints["llama"], path)
    gen_config = json.loads((path / "generation_config.json").read_text())
    gen_config["eos_token_id"] = [gen_config["eos_token_id"], ids[k]]
    (path / "generation_config.json").write_text(json.dumps(gen_config))
    eos_pipe = mii_server.pipeline(str(path), kv_cache={"block_size": 16, "num_blocks": 64})
    return eos_pipe, ids, k


def test_eos_stops(eos_setup: tuple[Pipeline, list[int], int], pipe: Pipeline) -> None:
    eos_pipe, ids, k = eos_setup
    r = greedy(eos_pipe, EOS_PROMPT, ignore_eos=False)
    assert r.token_ids == ids[: k + 1] and r.finish_reason == "stop"
    assert r.generated_text == greedy(pipe, EOS_PROMPT, max_new_tokens=k).generated_text


def test_eos_still_stops_when_stop_strings_are_given(eos_setup: tuple[Pipeline, list[int], int]) -> None:
    eos_pipe, ids, k = eos_setup
    r = greedy(eos_pipe, EOS_PROMPT, ignore_eos=False, stop=["\u00a7never\u00a7", "\u00b6"])
    assert r.token_ids == ids[: k + 1] and r.finish_reason == "stop"


def test_ignore_eos(eos_setup: tuple[Pipeline, list[int], int]) -> None:
    eos_pipe, ids, _ = eos_setup
    r = greedy(eos_pipe, EOS_PROMPT, ignore_eos=True)
    assert r.token_ids == ids and r.finish_reason == "length"


def test_min_new_tokens_suppresses_eos(eos_setup: tuple[Pipeline, list[int], int]) -> None:
    eos_pipe, ids, k = eos_setup
    r = greedy(eos_pipe, EOS_PROMPT, ignore_eos=False, min_new_tokens=k + 2)
    assert r.token_ids[:k] == ids[:k]
    assert ids[k] not in r.token_ids[: k + 2]  # EOS was banned, the next best token taken
    assert r.generated_length >= k + 2
    assert r.finish_reason == ("stop" if r.token_ids[-1] == ids[k] else "length")
