"""The step channel on its own: delivery to every follower, and a port that is reusable at once."""

from __future__ import annotations

import pytest
import zmq
from server.helpers import free_port_block

from mii_server.batching.step import Step
from mii_server.errors import EngineDead
from mii_server.tensor_parallel.channel import StepPublisher, StepSubscriber


def test_steps_reach_every_follower_and_the_port_is_reusable_after_close() -> None:
    port = free_port_block(1)
    for _round in range(3):  # a destroyed pipeline's port is bound again by the next one, at once
        publisher = StepPublisher("127.0.0.1", port)
        followers = [StepSubscriber("127.0.0.1", port) for _ in range(3)]
        publisher.wait_for_subscribers(3, timeout_s=30)
        publisher.publish(Step(stop=True))
        for follower in followers:
            assert follower.receive(timeout_s=30).stop
            follower.close()
        publisher.close()


def test_a_port_held_by_another_listener_is_a_clear_error() -> None:
    port = free_port_block(1)
    holder = zmq.Context.instance().socket(zmq.PUB)
    holder.bind(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(zmq.ZMQError, match="Address already in use"):
            StepPublisher("127.0.0.1", port)
    finally:
        holder.close(linger=0)


def test_too_few_subscribers_is_engine_dead() -> None:
    publisher = StepPublisher("127.0.0.1", 0)
    try:
        with pytest.raises(EngineDead, match="only 0 of 1"):
            publisher.wait_for_subscribers(1, timeout_s=0.2)
    finally:
        publisher.close()
