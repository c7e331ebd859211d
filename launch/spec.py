"""What a child process is told: its role and its spec, as url-safe base64 JSON on its command line.

The supervisor's children get a ``LaunchSpec`` (the whole deployment, and for a replica its index),
from which the role derives its own config (``serving.control.roles``); a replica's tensor-parallel
ranks get a ``RankSpec`` from their rank 0, which may run under the supervisor or on its own
(``mii-server replica``). JSON, never pickle, and no secret: secrets travel by environment or file.
"""

from __future__ import annotations

import base64
import sys
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..serving.control.deployment import DeploymentConfig
from ..serving.control.roles import ReplicaRole

Role = Literal["supervisor", "replica", "replica-rank", "load-balancer", "rest-gateway", "openai-server"]
ROLES: tuple[Role, ...] = (
    "supervisor",
    "replica",
    "replica-rank",
    "load-balancer",
    "rest-gateway",
    "openai-server",
)


class LaunchSpec(BaseModel):
    """What a child of the supervisor is told: the deployment, and for a replica which one it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    deployment: DeploymentConfig = Field(description="The whole deployment's configuration.")
    replica_index: int | None = Field(default=None, ge=0, description="Which replica (role replica only).")


class RankLink(BaseModel):
    """What rank 0 of a replica tells each follower rank it starts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=1, description="This follower's rank (1..T-1).")
    store_port: int = Field(ge=1, le=65535, description="Rank 0's torch.distributed TCPStore port.")
    channel_port: int = Field(ge=1, le=65535, description="Rank 0's ZMQ step publisher port.")


class RankSpec(BaseModel):
    """What a tensor-parallel follower (role replica-rank) is told by the rank 0 that starts it."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    replica: ReplicaRole = Field(description="The replica this rank belongs to.")
    rank_link: RankLink = Field(description="How this rank finds its rank 0.")


Spec = LaunchSpec | RankSpec


def encode(spec: Spec) -> str:
    return base64.urlsafe_b64encode(spec.model_dump_json().encode()).decode("ascii")


def decode(role: Role, text: str) -> Spec:
    """The spec of a ``role`` process (a ``RankSpec`` for replica-rank, else a ``LaunchSpec``)."""
    kind = RankSpec if role == "replica-rank" else LaunchSpec
    return kind.model_validate_json(base64.urlsafe_b64decode(text.encode("ascii")))


def command(role: Role, spec: Spec) -> list[str]:
    return [sys.executable, "-m", "mii_server.launch", "--role", role, "--config", encode(spec)]
