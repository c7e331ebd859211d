"""What a child process is told: its role and a ``LaunchSpec``, as url-safe base64 JSON on its command line.

JSON, never pickle, and no secret: secrets travel by environment or file.
"""

from __future__ import annotations

import base64
import sys
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..serving.control.deployment import DeploymentConfig

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
    """Everything one child needs: the deployment, and for a replica which one it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    deployment: DeploymentConfig = Field(description="The whole deployment's configuration.")
    replica_index: int | None = Field(default=None, ge=0, description="Which replica (role replica only).")
    rank_link: RankLink | None = Field(
        default=None, description="How a tensor-parallel follower finds its rank 0 (role replica-rank only)."
    )


class RankLink(BaseModel):
    """What rank 0 of a replica tells each follower rank it starts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=1, description="This follower's rank (1..T-1).")
    store_port: int = Field(ge=1, le=65535, description="Rank 0's torch.distributed TCPStore port.")
    channel_port: int = Field(ge=1, le=65535, description="Rank 0's ZMQ step publisher port.")


LaunchSpec.model_rebuild()


def encode(spec: LaunchSpec) -> str:
    return base64.urlsafe_b64encode(spec.model_dump_json().encode()).decode("ascii")


def decode(text: str) -> LaunchSpec:
    return LaunchSpec.model_validate_json(base64.urlsafe_b64decode(text.encode("ascii")))


def command(role: Role, spec: LaunchSpec) -> list[str]:
    return [sys.executable, "-m", "mii_server.launch", "--role", role, "--config", encode(spec)]
