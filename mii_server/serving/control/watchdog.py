"""The supervisor's watchdog: kill a replica that is alive but hung, so the supervisor restarts it.

A crashed replica exits and is restarted by the supervisor's watch loop; a hung one (stopped with
SIGSTOP, wedged in a GPU call, its event loop blocked) never exits. Every ``CHECK_S`` the watchdog asks
each replica's ``Stats``; a replica that has answered once and then shows no working engine for the
stall timeout (no answer, or one engine step running that long) gets SIGKILL, and the restart follows.
A replica that has not been seen working yet (armed by the supervisor once ready, or by its first
working answer) is still starting (importing, loading): the start-up deadline covers it, not this.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import grpc

from ...wire import generation_pb2 as pb
from ...wire import generation_pb2_grpc
from .. import grpc_common
from ..security import GrpcSecurity

log = logging.getLogger(__name__)

CHECK_S = 1.0
ANSWER_TIMEOUT_S = 1.0


class ReplicaWatchdog:
    """Watches replicas given as (address, pid of the process now serving it) by ``targets()``."""

    def __init__(
        self,
        targets: Callable[[], list[tuple[str, int]]],
        stall_timeout_s: float,
        stop: threading.Event,
        security: GrpcSecurity,
    ) -> None:
        self._targets = targets
        self._stall_timeout_s = stall_timeout_s
        self._stop = stop
        self._security = security
        self._channels: dict[str, grpc.Channel] = {}
        self._alive_at: dict[int, float] = {}  # pid -> last time it showed a working engine
        self.killed: list[int] = []  # pids this watchdog killed

    def arm(self, pid: int) -> None:
        """Count ``pid`` as working now (the supervisor saw it serve): from here on, silence counts."""
        self._alive_at[pid] = time.monotonic()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="replica-watchdog", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        try:
            while not self._stop.wait(CHECK_S):
                for address, pid in self._targets():
                    self.check(address, pid)
        finally:
            for channel in self._channels.values():
                channel.close()

    def check(self, address: str, pid: int) -> None:
        """One look at one replica; SIGKILL its process group when it is hung."""
        now = time.monotonic()
        if self._working(address):
            self._alive_at[pid] = now
            return
        last = self._alive_at.get(pid)
        if last is None or now - last <= self._stall_timeout_s:
            return  # still starting, or silent for less than the timeout
        log.error(
            "replica %s (pid %d) has shown no working engine for %.0fs; killing it for a restart",
            address, pid, now - last,
        )  # fmt: skip
        self._alive_at.pop(pid, None)
        self.killed.append(pid)
        try:
            os.killpg(pid, signal.SIGKILL)  # the replica leads its group: its tensor-parallel ranks go too
        except ProcessLookupError:
            pass

    def _working(self, address: str) -> bool:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc_common.security_channel(address, self._security)
        try:
            reply = generation_pb2_grpc.GenerationStub(channel).Stats(pb.StatsRequest(), timeout=ANSWER_TIMEOUT_S)
        except grpc.RpcError:
            return False
        return all(entry.busy_step_s <= self._stall_timeout_s for entry in reply.replicas)
