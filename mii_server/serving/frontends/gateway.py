"""The gateway role: the REST gateway and/or the OpenAI server of one ``GatewayRole``, in one process.

The supervisor starts one front end per child (``rest-gateway``, ``openai-server``); ``mii-server
gateway`` starts the ones its flags name (both may run in one process). Each front end serves from its
own thread; the main thread waits for SIGTERM/SIGINT, then stops them together: they stop listening,
finish the requests they carry (within ``stop_grace_s``; a second signal cuts them) and the process
exits 0. A front end whose thread dies makes the process exit 1, so it is restarted.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Protocol

from ... import gc_heap
from ..control.roles import GatewayRole
from ..stopping import STOP_SIGNALS

log = logging.getLogger(__name__)

CHECK_S = 0.5  # how often the main thread checks that every front end still serves


class FrontEnd(Protocol):
    name: str

    def start(self) -> None: ...

    def is_alive(self) -> bool: ...

    def stop(self, forced: threading.Event) -> None: ...


def run_gateway(role: GatewayRole) -> int:
    """Serve ``role``'s front ends until SIGTERM/SIGINT (exit 0) or until one dies (exit 1)."""
    requested, forced = threading.Event(), threading.Event()

    def on_signal(*_: object) -> None:
        if requested.is_set():
            forced.set()
        requested.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    fronts: list[FrontEnd] = []
    if role.rest_port is not None:
        from .rest_gateway import RestGatewayServer

        fronts.append(RestGatewayServer(role))
    if role.openai_port is not None:
        from .openai_server import OpenAIServerThread

        fronts.append(OpenAIServerThread(role))
    for front in fronts:
        front.start()
    gc_heap.freeze_startup_heap(", ".join(f.name for f in fronts))
    code = 0
    while not requested.wait(CHECK_S):
        dead = [f.name for f in fronts if not f.is_alive()]
        if dead:
            log.error("%s stopped serving; exiting for a restart", ", ".join(dead))
            code = 1
            break
    log.info("stopping %s: finishing open requests", ", ".join(f.name for f in fronts))
    stoppers = [threading.Thread(target=f.stop, args=(forced,), name=f"stop-{f.name}") for f in fronts]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join()
    log.info("%s stopped", ", ".join(f.name for f in fronts))
    return code
