"""Unit: per-prompt round robin, skipping replicas that are down."""

from __future__ import annotations

import pytest

from mii_server.errors import ReplicaUnavailable
from mii_server.serving.routing.router import RoundRobinRouter, group_by_replica


def test_one_request_spreads_over_all_replicas() -> None:
    router = RoundRobinRouter(3)
    assert router.assign(7) == [0, 1, 2, 0, 1, 2, 0]
    assert router.assign(2) == [1, 2]  # the turn carries over between requests
    assert [router.routed(i) for i in range(3)] == [3, 3, 3]


def test_down_replicas_are_skipped_and_come_back() -> None:
    router = RoundRobinRouter(3)
    router.mark(1, False)
    assert set(router.assign(4)) == {0, 2}
    router.mark(1, True)
    assert set(router.assign(3)) == {0, 1, 2}


def test_all_down_still_tries_and_exclusions_are_final() -> None:
    router = RoundRobinRouter(2)
    router.mark(0, False)
    router.mark(1, False)
    assert set(router.assign(2)) == {0, 1}  # the health monitor may lag behind a restart
    assert router.assign(2, exclude={0}) == [1, 1]
    with pytest.raises(ReplicaUnavailable):
        router.assign(1, exclude={0, 1})


def test_group_by_replica_keeps_prompt_order() -> None:
    assert group_by_replica([0, 1, 2, 3, 4], [0, 1, 0, 1, 0]) == {0: [0, 2, 4], 1: [1, 3]}
