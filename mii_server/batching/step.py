"""Step: what every tensor-parallel rank executes in one iteration (the broadcast contract)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def fed_back_placeholder(row: int) -> int:
    """The token that stands for id ``row`` of the previous step's sampled ids (see
    ``InferenceEngine.feed_back``)."""
    return -1 - row


@dataclass
class Step:
    """One iteration of the replica loop: flush these sequences, then run one ragged forward."""

    flush_uids: list[int] = field(default_factory=list)  # sequences whose KV blocks are freed first
    uids: list[int] = field(default_factory=list)  # sequences in the forward, in batch order
    # new tokens of each sequence; a negative entry is a placeholder (``fed_back_placeholder``) for a
    # token the previous step sampled on the device and the engine feeds back without the host
    tokens: list[list[int]] = field(default_factory=list)
    # batch indices (into uids) whose every new token needs logits (prompt log-probabilities)
    full_logits: list[int] = field(default_factory=list)
    # prefix caching (every rank keeps a twin of the same cache and applies these alike):
    # (uid, block hashes): before the forward, the new sequence uid starts from the cached blocks
    # of these hashes
    cached_prefix: list[tuple[int, list[bytes]]] = field(default_factory=list)
    # (uid, first block, block hashes): after the forward, those full blocks of uid hold that content
    register: list[tuple[int, int, list[bytes]]] = field(default_factory=list)
    stop: bool = False  # followers leave their loop (end of a pipeline call, or replica shutdown)
    # with stop, for pipeline(all_rank_output=True): the call's responses as Response.to_msg_dict()s
    responses: list[dict[str, Any]] | None = None

    def to_msg(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"flush": self.flush_uids, "uids": self.uids, "tokens": self.tokens}
        msg["stop"] = self.stop
        for key, value in (("full_logits", self.full_logits), ("cached_prefix", self.cached_prefix),
                           ("register", self.register), ("responses", self.responses)):  # fmt: skip
            if value:  # (most steps carry none of these: keep their messages small)
                msg[key] = value
        return msg

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> Step:
        return cls(
            flush_uids=msg["flush"], uids=msg["uids"], tokens=msg["tokens"], stop=msg["stop"],
            full_logits=msg.get("full_logits", []),
            cached_prefix=[(uid, hashes) for uid, hashes in msg.get("cached_prefix", [])],
            register=[(uid, first, hashes) for uid, first, hashes in msg.get("register", [])],
            responses=msg.get("responses"),
        )  # fmt: skip

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def fed_back_count(self) -> int:
        """How many of the previous step's sampled ids this step's placeholders name (0: none):
        the prefix of the engine's fed-back ids every rank must hold before running it."""
        lowest = min(map(min, self.tokens), default=0)
        return -lowest if lowest < 0 else 0
