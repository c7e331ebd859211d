"""The load balancer as a process: a ``grpc.aio`` server over the replicas, with its health monitor.

Exit status 0 after Terminate (which ends the deployment) or SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from .. import grpc_common
from ..control.deployment import DeploymentConfig
from .load_balancer import LoadBalancer

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0


def run_load_balancer(cfg: DeploymentConfig) -> int:
    return asyncio.run(_serve(cfg))


async def _serve(cfg: DeploymentConfig) -> int:
    balancer = LoadBalancer(cfg.replica_addresses, replica_wait_s=cfg.replica_wait_s)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, balancer.stop_requested.set)
    server, health = await grpc_common.start_server(balancer, cfg.host, cfg.port_number)

    async def on_change(any_up: bool, all_up: bool) -> None:
        await grpc_common.set_serving(health, any_up)
        await grpc_common.set_all_replicas_serving(health, all_up)

    monitor = asyncio.ensure_future(balancer.monitor(on_change))
    log.info("load balancer on %s over %s", cfg.lb_address, ", ".join(cfg.replica_addresses))
    await balancer.stop_requested.wait()
    await grpc_common.set_serving(health, False)
    await server.stop(grace=STOP_GRACE_S)
    monitor.cancel()
    await balancer.close()
    return 0
