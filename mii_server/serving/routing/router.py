"""Per-prompt round robin over a changing set of replicas, keyed by address, skipping the ones known
to be down (plain Python, no I/O)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from ...errors import ReplicaUnavailable


class RoundRobinRouter:
    """Assigns each prompt the next replica in turn; a 40-prompt request spreads over all replicas.

    Replicas are addresses (``host:port``), added and dropped while routing (DNS discovery). A replica
    starts "up" (optimistic: a failed call marks it down and the caller retries elsewhere); a health
    monitor marks replicas up or down as it observes them. Plain Python with no locks: the load
    balancer uses it from its one event loop.
    """

    def __init__(self, addresses: Iterable[str] = ()) -> None:
        self._next = 0  # counter over all prompts ever routed
        self._up: dict[str, bool] = {}  # insertion order is the round-robin order
        self._routed: dict[str, int] = {}  # prompts sent to each replica while it was a member
        self.update(addresses)

    @property
    def members(self) -> list[str]:
        return list(self._up)

    def update(self, addresses: Iterable[str]) -> tuple[list[str], list[str]]:
        """Make ``addresses`` the replica set: new ones join (up), missing ones leave; members that
        stay keep their state and counts. Returns (added, removed)."""
        wanted = list(dict.fromkeys(addresses))
        removed = [a for a in self._up if a not in wanted]
        added = [a for a in wanted if a not in self._up]
        for address in removed:
            del self._up[address]
            del self._routed[address]
        for address in added:
            self._up[address] = True
            self._routed[address] = 0
        return added, removed

    def mark(self, address: str, up: bool) -> None:
        if address in self._up:  # a replica dropped meanwhile stays dropped
            self._up[address] = up

    def is_up(self, address: str) -> bool:
        return self._up.get(address, False)

    def any_up(self) -> bool:
        return any(self._up.values())

    def all_up(self) -> bool:
        """Every member is up, and there is at least one."""
        return bool(self._up) and all(self._up.values())

    def routed(self, address: str) -> int:
        return self._routed.get(address, 0)

    def assign(self, num_prompts: int, exclude: Collection[str] = ()) -> list[str]:
        """The replica for each of ``num_prompts`` prompts, in order.

        Prefers replicas marked up; when all are marked down it still tries them (the monitor may lag
        behind a restart). Replicas in ``exclude`` (already failed for this request) are never chosen;
        when that leaves none (or there are no replicas), raises ``ReplicaUnavailable``.
        """
        allowed = [a for a in self._up if a not in exclude]
        if not allowed:
            what = "every replica is down" if self._up else "no replica is known (yet)"
            raise ReplicaUnavailable(f"no replica can take the request: {what}")
        candidates = [a for a in allowed if self._up[a]] or allowed
        out = []
        for _ in range(num_prompts):
            address = candidates[self._next % len(candidates)]
            self._next += 1
            self._routed[address] += 1
            out.append(address)
        return out


def group_by_replica(prompt_indices: list[int], replicas: list[str]) -> dict[str, list[int]]:
    """{replica: [prompt index, ...]} keeping prompt order within each replica."""
    groups: dict[str, list[int]] = {}
    for index, replica in zip(prompt_indices, replicas, strict=True):
        groups.setdefault(replica, []).append(index)
    return groups
