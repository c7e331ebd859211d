"""Role dispatch: one entry function per process role, each living in its own room.

Each runner derives the role's own config from the deployment (``serving.control.roles``) and calls
the room's entry function with it: the same function the ``mii-server`` role subcommands call with a
config built from flags. Every entry sets up, serves until told to stop, shuts down and returns its
exit status: 0 means "stopped on request"; the supervisor restarts a child only after any other
status (see ``serving.control.supervisor``). SIGTERM and SIGINT are requests to stop. Heavy rooms
(the replica, which imports torch) are imported only by the role that needs them.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from ..serving.control.roles import GatewayRole, LoadBalancerRole, ReplicaRole
from .process import PARENT_PID_ENV
from .spec import LaunchSpec, RankSpec, Role

log = logging.getLogger(__name__)


def _check_parent() -> None:
    """Exit if the supervisor died before this child could arm PR_SET_PDEATHSIG."""
    expected = os.environ.get(PARENT_PID_ENV)
    if expected and os.getppid() != int(expected):
        log.error("supervisor %s is gone; exiting", expected)
        sys.exit(1)


def run_supervisor(spec: LaunchSpec) -> int:
    from ..serving.control.supervisor import Supervisor

    return Supervisor(spec.deployment).run()


def run_replica(spec: LaunchSpec) -> int:
    """Rank 0 of one replica: gRPC (the model service NOT_SERVING while it loads), then the engine."""
    from ..replica.main import run_replica as run

    _check_parent()
    assert spec.replica_index is not None, "the supervisor names the replica"
    return run(ReplicaRole.of_deployment(spec.deployment, spec.replica_index))


def run_replica_rank(spec: RankSpec) -> int:
    """Ranks 1..T-1 of a replica, started by its rank 0 (see ``replica.tensor_parallel``)."""
    from ..replica.tensor_parallel import run_follower

    _check_parent()
    return run_follower(spec)


def run_load_balancer(spec: LaunchSpec) -> int:
    from ..serving.routing.main import run_load_balancer as run

    _check_parent()
    return run(LoadBalancerRole.of_deployment(spec.deployment))


def run_rest_gateway(spec: LaunchSpec) -> int:
    from ..serving.frontends.gateway import run_gateway

    _check_parent()
    return run_gateway(GatewayRole.of_deployment(spec.deployment, "rest"))


def run_openai_server(spec: LaunchSpec) -> int:
    from ..serving.frontends.gateway import run_gateway

    _check_parent()
    return run_gateway(GatewayRole.of_deployment(spec.deployment, "openai"))


RUNNERS: dict[Role, Callable[[Any], int]] = {  # each takes its role's spec (spec.decode)
    "supervisor": run_supervisor,
    "replica": run_replica,
    "replica-rank": run_replica_rank,
    "load-balancer": run_load_balancer,
    "rest-gateway": run_rest_gateway,
    "openai-server": run_openai_server,
}
