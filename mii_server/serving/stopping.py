"""How every role stops: SIGTERM (or SIGINT) asks it to drain, a second signal cuts the drain short.

A role asked to stop turns its health NOT_SERVING, refuses new work, lets what it carries finish
within its ``stop_grace_s`` (None: no limit of its own; the supervisor's or Kubernetes' SIGKILL is
the bound), then exits 0.
"""

from __future__ import annotations

import asyncio
import signal

import grpc

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
NO_LIMIT_S = 365 * 24 * 3600.0  # "no limit" for APIs that need a number (grpc's stop(grace=None) aborts at once)


class StopRequest:
    """The stop signals of an asyncio process: ``requested`` at the first, ``forced`` at the second."""

    def __init__(self, requested: asyncio.Event | None = None) -> None:
        """``requested``: an event that other causes (a Terminate RPC) may also set."""
        self.requested = requested or asyncio.Event()
        self.forced = asyncio.Event()

    def install(self) -> None:
        """Handle STOP_SIGNALS on the running loop (call from the main thread, inside the loop)."""
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        if self.requested.is_set():
            self.forced.set()
        self.requested.set()


async def drain_server(server: grpc.aio.Server, grace_s: float | None, stop: StopRequest) -> None:
    """Stop ``server``: no new RPCs at once, open ones finish within ``grace_s`` (None: no limit), and
    all are cut when ``stop.forced`` is set first."""
    stopping = asyncio.ensure_future(server.stop(NO_LIMIT_S if grace_s is None else grace_s))
    forced = asyncio.ensure_future(stop.forced.wait())
    try:
        await asyncio.wait({stopping, forced}, return_when=asyncio.FIRST_COMPLETED)
        if not stopping.done():
            await server.stop(0)  # a shorter grace overrides the running stop
        await stopping
    finally:
        forced.cancel()
