"""The step channel: rank 0 publishes every Step; ranks 1..T-1 receive it. ZMQ PUB/SUB, msgpack.

No pickle crosses the socket: a Step is lists of ints and a flag. The publisher binds loopback by
default (a configured interface for multi-host) and waits until every follower has subscribed, so
no step is lost to ZMQ's slow-joiner window. Idle followers block in poll(); they do not spin.

Both ends use the process-wide ZMQ context and never terminate it: ``zmq_ctx_term`` can block
forever in a shutdown race even after every socket closed with LINGER=0 (libzmq issue 2586; seen
here as a 4-rank pipeline hanging in ``destroy()`` about once in 16 runs). A socket closed with
linger 0 gives back its port and buffers at once; the context's I/O thread ends with the process.
"""

from __future__ import annotations

import time

import msgpack
import zmq

from ..batching.step import Step
from ..errors import EngineDead

# A publisher closed moments ago in this process (a destroyed pipeline) frees its port asynchronously.
REBIND_S = 2.0


class StepPublisher:
    def __init__(self, host: str, port: int) -> None:
        self._socket = zmq.Context.instance().socket(zmq.XPUB)  # XPUB: subscriptions arrive as messages we can count
        self._socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber, not just the first
        self._socket.setsockopt(zmq.SNDHWM, 0)  # never drop a step
        self._bind(f"tcp://{host}:{port or '*'}")
        # the bound port (the OS picks one when ``port`` is 0)
        self.port = int(self._socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])

    def _bind(self, endpoint: str) -> None:
        deadline = time.monotonic() + REBIND_S
        while True:
            try:
                self._socket.bind(endpoint)
                return
            except zmq.ZMQError as err:
                if err.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    self._socket.close(linger=0)
                    raise
            time.sleep(0.02)

    def wait_for_subscribers(self, count: int, timeout_s: float) -> None:
        """Block until ``count`` followers have subscribed; EngineDead after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        while seen < count:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._socket.poll(left_ms):
                raise EngineDead(f"only {seen} of {count} tensor-parallel followers subscribed in {timeout_s:.0f}s")
            if self._socket.recv()[:1] == b"\x01":  # subscribe (0x00 would be unsubscribe)
                seen += 1

    def publish(self, step: Step) -> None:
        self._socket.send(msgpack.packb(step.to_msg()))

    def close(self) -> None:
        self._socket.close(linger=0)


class StepSubscriber:
    def __init__(self, host: str, port: int) -> None:
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(f"tcp://{host}:{port}")

    def receive(self, timeout_s: float) -> Step:
        """The next Step; EngineDead when rank 0 has been silent for ``timeout_s`` (it heartbeats)."""
        if not self._socket.poll(int(timeout_s * 1000)):
            raise EngineDead(f"rank 0 has been silent for {timeout_s:.0f}s")
        return Step.from_msg(msgpack.unpackb(self._socket.recv()))

    def close(self) -> None:
        self._socket.close(linger=0)
