"""Role dispatch: one entry function per process role, each living in its own room.

Every entry sets up, serves until told to stop, shuts down and returns its exit status: 0 means
"stopped on request"; the supervisor restarts a child only after any other status (see
``serving.control.supervisor``). SIGTERM and SIGINT are requests to stop. Heavy rooms (the replica,
which imports torch) are imported only by the role that needs them.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from .process import PARENT_PID_ENV
from .spec import LaunchSpec, Role

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
    """Rank 0 of one replica: gRPC (NOT_SERVING while the model loads), then the engine."""
    from ..replica.main import run_replica as run

    _check_parent()
    return run(spec)


def run_replica_rank(spec: LaunchSpec) -> int:
    """Ranks 1..T-1 of a replica, started by its rank 0 (see ``replica.tensor_parallel``)."""
    from ..replica.tensor_parallel import run_follower

    _check_parent()
    return run_follower(spec)


def run_load_balancer(spec: LaunchSpec) -> int:
    from ..serving.routing.main import run_load_balancer as run

    _check_parent()
    return run(spec.deployment)


def run_rest_gateway(spec: LaunchSpec) -> int:
    from ..serving.frontends.rest_gateway import serve_rest_gateway

    _check_parent()
    return serve_rest_gateway(spec.deployment)


def run_openai_server(spec: LaunchSpec) -> int:
    from ..serving.frontends.openai_server import serve_openai_server

    _check_parent()
    return serve_openai_server(spec.deployment)


RUNNERS: dict[Role, Callable[[LaunchSpec], int]] = {
    "supervisor": run_supervisor,
    "replica": run_replica,
    "replica-rank": run_replica_rank,
    "load-balancer": run_load_balancer,
    "rest-gateway": run_rest_gateway,
    "openai-server": run_openai_server,
}
