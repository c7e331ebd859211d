"""Rank 0 of one replica as a process: gRPC at once, the engine once the model has loaded.

Health: ``""`` (the process, a liveness probe) is SERVING from the moment the server listens;
``mii_server.wire.Generation`` (the model, a readiness or startup probe) only once the engine runs.
Both turn NOT_SERVING the moment the replica is asked to stop (SIGTERM, SIGINT, Terminate): new RPCs
are refused with UNAVAILABLE (the load balancer retries them elsewhere), open ones finish within
``stop_grace_s``, then the engine stops. A second signal cuts the open RPCs.

Runs one asyncio event loop: the ``grpc.aio`` server, its RPC tasks and the relay's deliveries. The
model loads on a worker thread so health answers while it does; the batching loop runs on its own
thread from then on. Exit status: 0 when asked to stop, 1 when the batching loop died (so the
supervisor, or Kubernetes, restarts the replica).
"""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health as grpc_health

from .. import gc_heap
from ..serving import grpc_common
from ..serving.control.roles import ReplicaRole
from ..serving.stopping import StopRequest, drain_server
from .relay import UpdateRelay
from .servicer import ReplicaServicer
from .tensor_parallel import ReplicaEngine

log = logging.getLogger(__name__)

ENGINE_CHECK_S = 1.0  # how often a replica checks that its batching loop still runs
DEAD_ENGINE_GRACE_S = 1.0  # open RPCs cannot finish without an engine: cut them soon


def run_replica(role: ReplicaRole) -> int:
    return asyncio.run(_serve(role))


async def _serve(role: ReplicaRole) -> int:
    index = role.replica_index
    loop = asyncio.get_running_loop()
    servicer = ReplicaServicer(
        index, role.address, max_queued_requests=role.max_queued_requests, model_name=role.served_model
    )
    stop = StopRequest(servicer.stop_requested)
    stop.install()
    start_replica_metrics(role, servicer)
    server, health = await grpc_common.start_server(servicer, role.host, role.port, role.grpc_security())
    await grpc_common.set_service_serving(health, "", True)  # the process serves; the model not yet
    unready = asyncio.ensure_future(_not_serving_once_stopped(stop, health))
    log.info("replica %d listening on %s; loading %r", index, role.address, role.model.model_name_or_path or "demo")
    relay = UpdateRelay(loop)
    # why not cancellable: a load cannot be interrupted; a stop during it waits, then shuts the engine down
    engine = await loop.run_in_executor(None, ReplicaEngine, role, relay.flush)
    gc_heap.freeze_startup_heap(f"replica {index}")
    code = 0
    try:
        if not stop.requested.is_set():
            servicer.attach(engine.driver, relay)
            await grpc_common.set_serving(health, True)
            log.info("replica %d serving", index)
            code = await _watch(engine, stop, index)
        await grpc_common.set_serving(health, False)
        if code == 0:
            log.info("replica %d stopping: finishing open requests", index)
            await drain_server(server, role.stop_grace_s, stop)
        else:
            await server.stop(DEAD_ENGINE_GRACE_S)
    finally:
        unready.cancel()
        await loop.run_in_executor(None, engine.shutdown)
        servicer.close()
    log.info("replica %d stopped", index)
    return code


async def _not_serving_once_stopped(stop: StopRequest, health: grpc_health.aio.HealthServicer) -> None:
    """Health turns NOT_SERVING the moment a stop is asked, even while the model still loads."""
    await stop.requested.wait()
    await grpc_common.set_serving(health, False)


async def _watch(engine: ReplicaEngine, stop: StopRequest, index: int) -> int:
    """Wait for a stop request (0) or the batching loop's death (1)."""
    while not stop.requested.is_set():
        try:
            await asyncio.wait_for(stop.requested.wait(), ENGINE_CHECK_S)
        except asyncio.TimeoutError:
            pass
        if not engine.driver.alive:  # exit non-zero so the supervisor (or Kubernetes) restarts us
            log.error("replica %d: engine died; exiting for a restart", index)
            return 1
    return 0


def start_replica_metrics(role: ReplicaRole, servicer: ReplicaServicer) -> None:
    """Serve the replica's Prometheus ``/metrics`` and ``/health`` on its metrics port, if it has one."""
    if role.metrics_port is None:
        return
    from ..serving.metrics import EngineStatsCollector, start_metrics_server

    servicer.metrics.registry.register(EngineStatsCollector(servicer.engine_stats))
    start_metrics_server(role.host, role.metrics_port, servicer.metrics.registry, servicer.health)
    log.info("replica %d metrics on http://%s:%d/metrics", role.replica_index, role.host, role.metrics_port)
