"""The load balancer as a process: a ``grpc.aio`` server over the replicas, its health monitor, and
(for ``dns:///`` replica names) the re-resolution that adds and drops replicas while it runs.

Health: ``""`` is the process itself, SERVING from start until asked to stop (a liveness or readiness
probe that a replica outage never fails); ``mii_server.wire.Generation`` is SERVING while at least
one replica is routable, ``mii_server.AllReplicas`` while every known replica is (the supervisor
waits for it). Exit status 0 after Terminate (which ends a supervised deployment) or SIGTERM/SIGINT:
health turns NOT_SERVING, new RPCs are refused, open ones finish within ``stop_grace_s``.
"""

from __future__ import annotations

import asyncio
import logging

from ... import gc_heap
from .. import grpc_common
from ..control.roles import LoadBalancerRole
from ..stopping import StopRequest, drain_server
from .discovery import ReplicaDiscovery, parse_targets
from .load_balancer import LoadBalancer

log = logging.getLogger(__name__)


def run_load_balancer(role: LoadBalancerRole) -> int:
    return asyncio.run(_serve(role))


async def _serve(role: LoadBalancerRole) -> int:
    discovery = ReplicaDiscovery(parse_targets(role.replicas))
    security = role.grpc_security()
    balancer = LoadBalancer(
        await discovery.resolve(), replica_wait_s=role.replica_wait_s, stall_timeout_s=role.replica_stall_timeout_s,
        security=security,
    )  # fmt: skip
    stop = StopRequest(balancer.stop_requested)
    stop.install()
    server, health = await grpc_common.start_server(balancer, role.host, role.port, security)
    await grpc_common.set_service_serving(health, "", True)
    gc_heap.freeze_startup_heap("load balancer")

    async def on_change(any_up: bool, all_up: bool) -> None:
        if not stop.requested.is_set():
            await grpc_common.set_service_serving(health, grpc_common.SERVICE_NAME, any_up)
            await grpc_common.set_all_replicas_serving(health, all_up)

    tasks = [asyncio.ensure_future(balancer.monitor(on_change))]
    if discovery.dynamic:
        tasks.append(asyncio.ensure_future(balancer.follow(discovery, role.resolve_interval_s)))
    log.info(
        "load balancer on %s over %s (now %s)",
        role.address, ", ".join(role.replicas), ", ".join(balancer.addresses) or "no replica",
    )  # fmt: skip
    await stop.requested.wait()
    await grpc_common.set_serving(health, False)
    await grpc_common.set_all_replicas_serving(health, False)
    log.info("load balancer stopping: finishing open requests")
    await drain_server(server, role.stop_grace_s, stop)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await balancer.close()
    log.info("load balancer stopped")
    return 0
