"""What a caller may pass as prompts, checked once (no gRPC, no HTTP): the Python client, the REST gateway
and the OpenAI server all accept the same shapes.

A string is one prompt; a list of ints is one prompt of token ids; a list of strings and/or lists of
ints is several. Token ids must fit the wire's int64 here; the replica checks them against the
vocabulary.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequest
from ..generation.params import INT64_MAX
from .types import Prompt

Prompts = str | list[str] | list[int] | list[list[int]] | list[Prompt]


def prompt_list(prompts: Any, name: str = "prompts") -> list[Prompt]:
    """``prompts`` as a list of prompts: a string is one, a list of ints is one of token ids, a list of
    strings and/or lists of ints is several. ``InvalidRequest`` for anything else (a number, a dict, a
    bool among the ids, an id outside int64), before any traffic."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(_is_id(t) for t in prompts):
        return [_token_ids(prompts, name)]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequest(
            f"{name} must be a string, a list of strings, or token ids (a list of ints, or a list of such lists); "
            f"got {type(prompts).__name__}"
        )
    out: list[Prompt] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            out.append(prompt)
        elif isinstance(prompt, (list, tuple)) and all(_is_id(t) for t in prompt):
            out.append(_token_ids(prompt, f"{name}[{i}]"))
        else:
            raise InvalidRequest(f"{name}[{i}] must be a string or a list of token ids (ints); got {prompt!r:.80}")
    return out


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(ids: Any, name: str) -> list[int]:
    if not ids:
        raise InvalidRequest(f"{name} is an empty list of token ids")
    bad = next((t for t in ids if not 0 <= t <= INT64_MAX), None)
    if bad is not None:
        raise InvalidRequest(f"{name} has token id {bad}; token ids are integers from 0 to the vocabulary size - 1")
    return list(ids)
