"""Rank 0 of one replica as a process: gRPC at once (NOT_SERVING while the model loads), then the engine.

Runs one asyncio event loop: the ``grpc.aio`` server, its RPC tasks and the relay's deliveries. The
model loads on a worker thread so health answers while it does; the batching loop runs on its own
thread from then on. Exit status: 0 when asked to stop (Terminate, SIGTERM, SIGINT), 1 when the
batching loop died (so the supervisor restarts the replica).
"""

from __future__ import annotations

import asyncio
import logging
import signal

from ..launch.spec import LaunchSpec
from ..serving import grpc_common
from ..serving.control.deployment import DeploymentConfig
from .relay import UpdateRelay
from .servicer import ReplicaServicer
from .tensor_parallel import ReplicaEngine

log = logging.getLogger(__name__)

ENGINE_CHECK_S = 1.0  # how often a replica checks that its batching loop still runs
STOP_GRACE_S = 5.0  # in-flight RPCs get this long to finish once the replica is asked to stop


def run_replica(spec: LaunchSpec) -> int:
    return asyncio.run(_serve(spec))


async def _serve(spec: LaunchSpec) -> int:
    cfg = spec.deployment
    index = spec.replica_index or 0
    loop = asyncio.get_running_loop()
    servicer = ReplicaServicer(index, cfg.replica_addresses[index], max_queued_requests=cfg.max_queued_requests)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, servicer.stop_requested.set)
    start_replica_metrics(cfg, index, servicer)
    server, health = await grpc_common.start_server(servicer, cfg.host, cfg.replica_ports[index])
    log.info("replica %d listening on %s; loading %r", index, servicer.address, cfg.model.model_name_or_path or "demo")
    relay = UpdateRelay(loop)
    engine = await loop.run_in_executor(None, ReplicaEngine, spec, relay.flush)
    code = 0
    try:
        servicer.attach(engine.driver, relay)
        await grpc_common.set_serving(health, True)
        log.info("replica %d serving", index)
        while not servicer.stop_requested.is_set():
            try:
                await asyncio.wait_for(servicer.stop_requested.wait(), ENGINE_CHECK_S)
            except asyncio.TimeoutError:
                pass
            if not engine.driver.alive:  # the batching loop died: exit non-zero so the supervisor restarts us
                log.error("replica %d: engine died; exiting for a restart", index)
                code = 1
                break
        await grpc_common.set_serving(health, False)
        await server.stop(grace=STOP_GRACE_S if code == 0 else 1)
    finally:
        await loop.run_in_executor(None, engine.shutdown)
        servicer.close()
    log.info("replica %d stopped", index)
    return code


def start_replica_metrics(cfg: DeploymentConfig, index: int, servicer: ReplicaServicer) -> None:
    """Serve the replica's Prometheus ``/metrics`` and ``/health`` on its metrics port, if enabled."""
    if not cfg.enable_metrics:
        return
    from ..serving.metrics import EngineStatsCollector, start_metrics_server

    servicer.metrics.registry.register(EngineStatsCollector(servicer.engine_stats))
    port = cfg.replica_metrics_ports[index]
    start_metrics_server(cfg.host, port, servicer.metrics.registry, servicer.health)
    log.info("replica %d metrics on http://%s:%d/metrics", index, cfg.host, port)
