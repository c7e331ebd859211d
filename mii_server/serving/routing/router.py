"""Per-prompt round robin over replicas, skipping the ones known to be down (plain Python, no I/O)."""

from __future__ import annotations

from collections.abc import Collection

from ...errors import ReplicaUnavailable


class RoundRobinRouter:
    """Assigns each prompt the next replica in turn; a 40-prompt request spreads over all replicas.

    Replicas start "up" (optimistic: a failed call marks one down and the caller retries elsewhere);
    a health monitor marks them up or down as it observes them. Plain Python with no locks: the load
    balancer uses it from its one event loop.
    """

    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError("a router needs at least one replica")
        self._next = 0  # counter over all prompts ever routed
        self._up = [True] * num_replicas
        self._routed = [0] * num_replicas  # prompts sent to each replica slot

    @property
    def num_replicas(self) -> int:
        return len(self._up)

    def mark(self, replica: int, up: bool) -> None:
        self._up[replica] = up

    def is_up(self, replica: int) -> bool:
        return self._up[replica]

    def any_up(self) -> bool:
        return any(self._up)

    def all_up(self) -> bool:
        return all(self._up)

    def routed(self, replica: int) -> int:
        return self._routed[replica]

    def assign(self, num_prompts: int, exclude: Collection[int] = ()) -> list[int]:
        """The replica for each of ``num_prompts`` prompts, in order.

        Prefers replicas marked up; when all are marked down it still tries them (the monitor may lag
        behind a restart). Replicas in ``exclude`` (already failed for this request) are never chosen;
        when that leaves none, raises ``ReplicaUnavailable``.
        """
        allowed = [i for i in range(len(self._up)) if i not in exclude]
        if not allowed:
            raise ReplicaUnavailable("no replica can take the request: every replica is down")
        candidates = [i for i in allowed if self._up[i]] or allowed
        out = []
        for _ in range(num_prompts):
            replica = candidates[self._next % len(candidates)]
            self._next += 1
            self._routed[replica] += 1
            out.append(replica)
        return out


def group_by_replica(prompt_indices: list[int], replicas: list[int]) -> dict[int, list[int]]:
    """{replica: [prompt index, ...]} keeping prompt order within each replica."""
    groups: dict[int, list[int]] = {}
    for index, replica in zip(prompt_indices, replicas, strict=True):
        groups.setdefault(replica, []).append(index)
    return groups
