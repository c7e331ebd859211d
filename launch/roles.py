"""Process entry points, one per role: set up, serve until told to stop, shut down, exit 0.

Exit status 0 means "stopped on request"; the supervisor restarts a child only after any other
status (see ``supervisor``). SIGTERM and SIGINT are requests to stop.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

from ..serving import grpc_common
from .process import PARENT_PID_ENV
from .spec import LaunchSpec

if TYPE_CHECKING:
    from ..replica.servicer import ReplicaServicer
    from ..serving.control.deployment import DeploymentConfig

log = logging.getLogger(__name__)

ENGINE_CHECK_S = 1.0  # how often a replica checks that its batching loop still runs


def _stop_on_signals(stop: threading.Event) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())


def _check_parent() -> None:
    """Exit if the supervisor died before this child could arm PR_SET_PDEATHSIG."""
    expected = os.environ.get(PARENT_PID_ENV)
    if expected and os.getppid() != int(expected):
        log.error("supervisor %s is gone; exiting", expected)
        sys.exit(1)


def run_replica(spec: LaunchSpec) -> int:
    """Rank 0 of one replica: gRPC (NOT_SERVING while the model loads), then the engine."""
    from ..replica.servicer import ReplicaServicer
    from ..replica.tensor_parallel import ReplicaEngine  # why here: only replicas import torch

    _check_parent()
    cfg = spec.deployment
    index = spec.replica_index or 0
    address = cfg.replica_addresses[index]
    servicer = ReplicaServicer(index, address, max_queued_requests=cfg.max_queued_requests)
    _stop_on_signals(servicer.stop_requested)
    start_replica_metrics(cfg, index, servicer)  # /metrics and /health over HTTP (issue 6)
    server, health = grpc_common.start_server(servicer, cfg.host, cfg.replica_ports[index], max_workers=256)
    log.info("replica %d listening on %s; loading %r", index, address, cfg.model.model_name_or_path or "demo")
    engine = ReplicaEngine(spec)
    driver = engine.driver
    try:
        servicer.attach(driver)
        grpc_common.set_serving(health, True)
        log.info("replica %d serving", index)
        while not servicer.stop_requested.wait(ENGINE_CHECK_S):
            if not driver.alive:  # the batching loop died: exit non-zero so the supervisor restarts us
                log.error("replica %d: engine died; exiting for a restart", index)
                grpc_common.set_serving(health, False)
                server.stop(grace=1).wait()
                return 1
        grpc_common.set_serving(health, False)
        server.stop(grace=5).wait()
    finally:
        engine.shutdown()
    log.info("replica %d stopped", index)
    return 0


def run_replica_rank(spec: LaunchSpec) -> int:
    """Ranks 1..T-1 of a replica, started by its rank 0 (see ``tp_replica``)."""
    from ..replica.tensor_parallel import run_follower

    _check_parent()
    return run_follower(spec)


def run_load_balancer(spec: LaunchSpec) -> int:
    from ..serving.routing.load_balancer import LoadBalancer

    _check_parent()
    cfg = spec.deployment
    balancer = LoadBalancer(cfg.replica_addresses, replica_wait_s=cfg.replica_wait_s)
    _stop_on_signals(balancer.stop_requested)
    server, health = grpc_common.start_server(balancer, cfg.host, cfg.port_number, max_workers=256)
    def on_change(any_up: bool, all_up: bool) -> None:
        grpc_common.set_serving(health, any_up)
        grpc_common.set_all_replicas_serving(health, all_up)

    monitor = threading.Thread(target=balancer.monitor, args=(on_change,), daemon=True)
    monitor.start()
    log.info("load balancer on %s over %s", cfg.lb_address, ", ".join(cfg.replica_addresses))
    balancer.stop_requested.wait()
    grpc_common.set_serving(health, False)
    server.stop(grace=5).wait()
    balancer.close()
    return 0


def run_rest_gateway(spec: LaunchSpec) -> int:
    from ..serving.frontends.rest_gateway import serve_rest_gateway

    _check_parent()
    return serve_rest_gateway(spec.deployment)


def run_openai_server(spec: LaunchSpec) -> int:
    from ..serving.frontends.openai_server import serve_openai_server

    _check_parent()
    return serve_openai_server(spec.deployment)


def start_replica_metrics(cfg: DeploymentConfig, index: int, servicer: ReplicaServicer) -> None:
    """Serve the replica's Prometheus ``/metrics`` and ``/health`` on its metrics port, if enabled."""
    if not cfg.enable_metrics:
        return
    from ..serving.metrics import EngineStatsCollector, start_metrics_server

    servicer.metrics.registry.register(EngineStatsCollector(servicer.engine_stats))
    port = cfg.replica_metrics_ports[index]
    start_metrics_server(cfg.host, port, servicer.metrics.registry, servicer.health)
    log.info("replica %d metrics on http://%s:%d/metrics", index, cfg.host, port)


def run_supervisor(spec: LaunchSpec) -> int:
    from ..serving.control.supervisor import Supervisor

    return Supervisor(spec.deployment).run()


RUNNERS = {
    "supervisor": run_supervisor,
    "replica": run_replica,
    "replica-rank": run_replica_rank,
    "load-balancer": run_load_balancer,
    "rest-gateway": run_rest_gateway,
    "openai-server": run_openai_server,
}
