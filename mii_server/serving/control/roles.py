"""Per-role configs: exactly what one process of a deployment needs, whoever starts it.

The supervisor derives them from its ``DeploymentConfig`` (``of_deployment``); the role subcommands of
``mii-server`` (``replica``, ``load-balancer``, ``gateway``, as a Kubernetes pod runs them) derive them
from a config file of ``serve()`` kwargs plus flags (``standalone``). Either way the role's entry
function gets the same object, so a pod and a supervisor's child run the same code.

A field marked ``FLAG`` is one the role's subcommand sets by flag (``--host``, ``--port``...; the flag
is derived from the field, see ``mii_server.config_flags``); the others come from the config file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ...config import ModelConfig
from ...errors import InvalidRequest
from ..routing.discovery import parse_targets
from ..security import GrpcSecurity
from . import registry
from .deployment import DeploymentConfig

if TYPE_CHECKING:
    from ..frontends.client import Client

FLAG: dict[str, Any] = {"flag": True}  # json_schema_extra of a field its subcommand sets by flag
# the layout defaults are the deployment's (a role alone defaults to where the supervisor puts it)
_HOST: str = DeploymentConfig.model_fields["host"].default
_LB_PORT: int = DeploymentConfig.model_fields["port_number"].default

FrontEnd = Literal["rest", "openai"]


class _Role(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    deployment_name: str = Field(description="The deployment this process belongs to (logs, the REST path).")
    stop_grace_s: float | None = Field(
        default=None, ge=0, description="DeploymentConfig.stop_grace_s: how long a stop waits for open work."
    )
    api_key_file: str = Field(default="", description="DeploymentConfig.api_key_file.")
    tls_cert_file: str = Field(default="", description="DeploymentConfig.tls_cert_file.")
    tls_key_file: str = Field(default="", description="DeploymentConfig.tls_key_file.")
    tls_ca_file: str = Field(default="", description="DeploymentConfig.tls_ca_file.")

    def grpc_security(self) -> GrpcSecurity:
        """This process's gRPC security: its config's key file and TLS files, and the environment."""
        return GrpcSecurity.load(self.api_key_file, self.tls_cert_file, self.tls_key_file, self.tls_ca_file)

    @classmethod
    def flag_fields(cls) -> list[str]:
        """The fields the role's subcommand sets by flag, in declaration order."""
        return [name for name, f in cls.model_fields.items() if (f.json_schema_extra or {}).get("flag")]

    @classmethod
    def _validated(cls, values: dict[str, Any]) -> Any:
        try:
            return cls.model_validate(values)
        except ValidationError as err:
            raise InvalidRequest(f"invalid {cls.__name__} configuration: {err}") from None


class ReplicaRole(_Role):
    """One replica: rank 0's gRPC server and engine (it starts its tensor-parallel ranks itself)."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="What the replica loads.")
    host: str = Field(
        default=_HOST, description="Address the replica's gRPC and metrics ports bind.", json_schema_extra=FLAG
    )
    port: int = Field(default=_LB_PORT + 1, ge=1, le=65535, description="The replica's gRPC port.", json_schema_extra=FLAG)
    metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="HTTP port of Prometheus /metrics and /health; none: no such server (the config's "
        "metrics_port when it sets one and enable_metrics is on).",
        json_schema_extra=FLAG,
    )
    replica_index: int = Field(default=0, ge=0, description="Which replica of the deployment (metrics label, logs).")
    served_model: str = Field(default="", description="DeploymentConfig.served_model: the model id (a metrics label).")
    max_queued_requests: int | None = Field(default=1024, ge=0, description="DeploymentConfig.max_queued_requests.")
    registry_dir: str = Field(default="", description="The deployment's registry (tells its processes apart).")
    rank_log_dir: str = Field(
        default="",
        description="Folder of the tensor-parallel ranks' log files; empty: they write to this process's stderr.",
    )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def of_deployment(cls, cfg: DeploymentConfig, index: int) -> ReplicaRole:
        """Replica ``index`` of a supervised deployment."""
        metrics = cfg.replica_metrics_ports
        return cls(
            **_common(cfg),
            model=cfg.model,
            host=cfg.host,
            port=cfg.replica_ports[index],
            metrics_port=metrics[index] if metrics else None,
            replica_index=index,
            served_model=cfg.served_model,
            max_queued_requests=cfg.max_queued_requests,
            registry_dir=cfg.registry_dir,
            rank_log_dir=str(registry.log_dir(cfg.deployment_name, cfg.registry_dir)),
        )

    @classmethod
    def standalone(cls, cfg: DeploymentConfig, **flags: Any) -> ReplicaRole:
        """``mii-server replica``: the config's model and limits, the layout from ``flags``."""
        base = {
            **_common(cfg),
            "model": cfg.model,
            "host": cfg.host,
            "metrics_port": cfg.metrics_port if cfg.enable_metrics else None,
            "served_model": cfg.served_model,
            "max_queued_requests": cfg.max_queued_requests,
        }
        return cls._validated({**base, **flags})


class LoadBalancerRole(_Role):
    """The load balancer: a gRPC front over replicas named by address or by a DNS name it follows."""

    host: str = Field(default=_HOST, description="Address the load balancer binds.", json_schema_extra=FLAG)
    port: int = Field(default=_LB_PORT, ge=1, le=65535, description="The load balancer's gRPC port.", json_schema_extra=FLAG)
    replicas: list[str] = Field(
        min_length=1,
        description="The replicas: host:port, or dns:///NAME:PORT (re-resolved while running: every address the "
        "name has is a replica); comma-separated.",
        json_schema_extra=FLAG,
    )
    replica_wait_s: float = Field(default=30.0, ge=0, description="DeploymentConfig.replica_wait_s.")
    resolve_interval_s: float = Field(default=2.0, gt=0, description="DeploymentConfig.resolve_interval_s.")
    replica_stall_timeout_s: float = Field(default=20.0, gt=0, description="DeploymentConfig.replica_stall_timeout_s.")

    @field_validator("replicas")
    @classmethod
    def _targets_parse(cls, replicas: list[str]) -> list[str]:
        return [str(t) for t in parse_targets(replicas)]  # InvalidRequest (a ValueError) names a bad one

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def of_deployment(cls, cfg: DeploymentConfig) -> LoadBalancerRole:
        return cls(**_common(cfg), **_balancing(cfg), host=cfg.host, port=cfg.port_number, replicas=cfg.replica_addresses)

    @classmethod
    def standalone(cls, cfg: DeploymentConfig, **flags: Any) -> LoadBalancerRole:
        """``mii-server load-balancer``: the config's limits, the layout and the replicas from ``flags``."""
        return cls._validated({**_common(cfg), **_balancing(cfg), "host": cfg.host, "port": cfg.port_number, **flags})


class GatewayRole(_Role):
    """The HTTP front ends (REST gateway and/or OpenAI server) in front of one load balancer."""

    host: str = Field(default=_HOST, description="Address every front end binds.", json_schema_extra=FLAG)
    load_balancer: str = Field(
        default=f"{_HOST}:{_LB_PORT}", description="The load balancer to call, host:port.", json_schema_extra=FLAG
    )
    rest_port: int | None = Field(
        default=None, ge=1, le=65535, description="Serve the REST gateway on this port.", json_schema_extra=FLAG
    )
    openai_port: int | None = Field(
        default=None, ge=1, le=65535, description="Serve the OpenAI-compatible API on this port.", json_schema_extra=FLAG
    )
    served_model: str = Field(description="The model id of the OpenAI API.")
    rest_threads: int = Field(ge=1, description="The REST gateway's WSGI threads (DeploymentConfig.rest_gateway_threads).")
    rest_shared_port: bool = Field(
        default=False,
        description="Bind rest_port with SO_REUSEPORT, beside the other REST gateway processes of the deployment "
        "(the supervisor sets it when DeploymentConfig.rest_gateway_workers > 1).",
    )
    openai_shared_port: bool = Field(
        default=False,
        description="Bind openai_port with SO_REUSEPORT, beside the other OpenAI server processes of the "
        "deployment (the supervisor sets it when DeploymentConfig.openai_server_workers > 1).",
    )
    allowed_origins: list[str] = Field(
        default_factory=list, description="DeploymentConfig.allowed_origins: CORS origins (empty: off).", json_schema_extra=FLAG
    )
    max_request_body_bytes: int = Field(
        default=32 * 2**20, ge=1024, le=2**27, description="DeploymentConfig.max_request_body_bytes."
    )

    def upstream_client(self) -> Client:
        """The client of the load balancer, presenting this process's key (and trusting its TLS CA)."""
        from ..frontends.client import Client

        security = self.grpc_security()
        return Client(self.load_balancer, deployment_name=self.deployment_name, api_key=security.keys.first,
                      tls_ca_file=security.tls_ca_file)  # fmt: skip

    @model_validator(mode="after")
    def _serves_something(self) -> GatewayRole:
        if self.rest_port is None and self.openai_port is None:
            raise ValueError("a gateway serves the REST gateway (rest_port), the OpenAI API (openai_port) or both")
        if self.rest_port == self.openai_port:
            raise ValueError(f"the REST gateway and the OpenAI API cannot share port {self.rest_port}")
        return self

    @classmethod
    def of_deployment(cls, cfg: DeploymentConfig, front_end: FrontEnd) -> GatewayRole:
        """The supervisor's ``rest-gateway`` or ``openai-server`` child (one front end each)."""
        if front_end == "rest":
            layout = {"host": cfg.restful_api_host, "rest_port": cfg.restful_api_port,
                      "rest_shared_port": cfg.rest_gateway_workers > 1}  # fmt: skip
        else:
            layout = {"host": cfg.openai_api_host, "openai_port": cfg.openai_api_port,
                      "openai_shared_port": cfg.openai_server_workers > 1}  # fmt: skip
        return cls(**_common(cfg), **_fronting(cfg), load_balancer=cfg.lb_address, **layout)

    @classmethod
    def standalone(cls, cfg: DeploymentConfig, **flags: Any) -> GatewayRole:
        """``mii-server gateway``: the config's names and keys, the layout and the load balancer from ``flags``."""
        return cls._validated({**_common(cfg), **_fronting(cfg), "host": cfg.host, "load_balancer": cfg.lb_address, **flags})


def _common(cfg: DeploymentConfig) -> dict[str, Any]:
    return {
        "deployment_name": cfg.deployment_name,
        "stop_grace_s": cfg.stop_grace_s,
        "api_key_file": cfg.api_key_file,
        "tls_cert_file": cfg.tls_cert_file,
        "tls_key_file": cfg.tls_key_file,
        "tls_ca_file": cfg.tls_ca_file,
    }


def _balancing(cfg: DeploymentConfig) -> dict[str, Any]:
    return {
        "replica_wait_s": cfg.replica_wait_s,
        "resolve_interval_s": cfg.resolve_interval_s,
        "replica_stall_timeout_s": cfg.replica_stall_timeout_s,
    }


def _fronting(cfg: DeploymentConfig) -> dict[str, Any]:
    return {
        "served_model": cfg.served_model,
        "rest_threads": cfg.rest_gateway_threads,
        "allowed_origins": cfg.allowed_origins,
        "max_request_body_bytes": cfg.max_request_body_bytes,
    }
