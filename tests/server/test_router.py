"""Unit: per-prompt round robin over a changing set of replica addresses, skipping replicas that are down."""

from __future__ import annotations

import pytest

from mii_server.errors import ReplicaUnavailable
from mii_server.serving.routing.router import RoundRobinRouter, group_by_replica

A, B, C = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"


def test_one_request_spreads_over_all_replicas() -> None:
    router = RoundRobinRouter([A, B, C])
    assert router.assign(7) == [A, B, C, A, B, C, A]
    assert router.assign(2) == [B, C]  # the turn carries over between requests
    assert [router.routed(a) for a in (A, B, C)] == [3, 3, 3]


def test_down_replicas_are_skipped_and_come_back() -> None:
    router = RoundRobinRouter([A, B, C])
    router.mark(B, False)
    assert set(router.assign(4)) == {A, C}
    router.mark(B, True)
    assert set(router.assign(3)) == {A, B, C}


def test_all_down_still_tries_and_exclusions_are_final() -> None:
    router = RoundRobinRouter([A, B])
    router.mark(A, False)
    router.mark(B, False)
    assert set(router.assign(2)) == {A, B}  # the health monitor may lag behind a restart
    assert router.assign(2, exclude={A}) == [B, B]
    with pytest.raises(ReplicaUnavailable, match="every replica is down"):
        router.assign(1, exclude={A, B})


def test_members_join_and_leave_keeping_the_state_of_those_that_stay() -> None:
    router = RoundRobinRouter([A, B])
    router.assign(2)
    router.mark(B, False)
    assert router.update([B, C]) == ([C], [A])
    assert router.members == [B, C]
    assert not router.is_up(B) and router.routed(B) == 1  # kept
    assert router.is_up(C) and router.routed(C) == 0  # joins up (optimistic)
    assert set(router.assign(3)) == {C}
    router.mark(A, True)  # a replica that left stays gone
    assert router.members == [B, C] and not router.is_up(A) and router.routed(A) == 0
    assert router.all_up() is False
    router.mark(B, True)
    assert router.all_up() and router.any_up()


def test_an_empty_set_has_no_replica_to_offer() -> None:
    router = RoundRobinRouter()
    assert not router.any_up() and not router.all_up()
    with pytest.raises(ReplicaUnavailable, match="no replica is known"):
        router.assign(1)
    router.update([A])
    assert router.assign(2) == [A, A]


def test_group_by_replica_keeps_prompt_order() -> None:
    assert group_by_replica([0, 1, 2, 3, 4], [A, B, A, B, A]) == {A: [0, 2, 4], B: [1, 3]}
