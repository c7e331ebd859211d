"""Deployment configuration: how many replicas, which ports, which front ends (MII's ``MIIConfig``).

``DeploymentConfig.from_kwargs(model, **kwargs)`` splits ``serve()``'s kwargs between this config
and ``ModelConfig``; a name neither knows raises ``UnknownArgument`` before anything starts.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ...config import ModelConfig, merge_mii_config_dicts
from ...errors import InvalidRequest, UnknownArgument
from ..security import GrpcSecurity

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
REST_THREAD_HEADROOM = 64  # threads beyond admission: health, metrics, and requests about to be refused
UNBOUNDED_QUEUE_THREADS = 1024  # what an unbounded replica queue counts as, for sizing the REST gateway
MAX_REST_THREADS = 16384
# processes of an HTTP front end by default, chosen by measurement: docs/BENCHMARKS.md, "The REST gateway
# in several processes" and "The OpenAI server in several processes"
DEFAULT_HTTP_WORKERS = 4
CORES_PER_HTTP_WORKER = 4  # the replicas' and the load balancer's processes need cores too


def _http_workers(given: int | None) -> int:
    """An HTTP front end's process count: ``given``, or the default bounded by the usable cores (one
    process where the platform cannot share a port)."""
    if given is not None:
        return given
    if not hasattr(socket, "SO_REUSEPORT"):
        return 1
    return max(1, min(DEFAULT_HTTP_WORKERS, usable_cores() // CORES_PER_HTTP_WORKER))


def _http_workers_field(front_end: str, port: str, per_process: str = "") -> Any:
    """The ``*_api_workers`` field of one HTTP front end (its processes; see ``_http_workers``)."""
    return Field(
        default=None,
        ge=1,
        le=64,
        description=f"Processes of {front_end}, every one bound to {port} with SO_REUSEPORT (the kernel deals "
        f"incoming connections over them{per_process}). One Python process does its work on one core at "
        f"most. None: {DEFAULT_HTTP_WORKERS}, or one per {CORES_PER_HTTP_WORKER} CPU cores this process may "
        "use if that is fewer, and at least 1.",
    )


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as a container's cpuset sets it, where the OS tells)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


DeviceMap = Literal["auto"] | int | list[int] | list[list[int]] | dict[str, list[list[int]]]


class DeploymentConfig(BaseModel):
    """One deployment: its name, process layout and ports. Travels to every child as JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: ModelConfig = Field(default_factory=ModelConfig, description="What every replica loads.")
    deployment_name: str = Field(
        default="",
        description="Name in the registry and in the REST path; empty means '<model basename>-mii-deployment' "
        "('mii-server-demo-mii-deployment' for the built-in demo model).",
    )
    replica_num: int = Field(default=1, ge=1, le=256, description="Independent copies of the model.")
    host: str = Field(
        default="127.0.0.1",
        description="Address the load balancer and replicas bind and dial (gRPC has no auth: keep it "
        "on loopback unless the network is trusted).",
    )
    port_number: int = Field(
        default=50050,
        ge=1,
        le=65535,
        description="Load balancer's gRPC port; replica i listens on port_number + 1 + i * tensor_parallel.",
    )
    enable_restful_api: bool = Field(default=False, description="Start the REST gateway.")
    restful_api_host: str = Field(default="127.0.0.1", description="Address the REST gateway binds.")
    restful_api_port: int = Field(default=28080, ge=1, le=65535, description="REST gateway's HTTP port.")
    restful_api_threads: int | None = Field(
        default=None,
        ge=1,
        le=16384,
        description="Threads of the REST gateway's WSGI server (waitress; an in-flight request holds one while "
        "it waits). None sizes it from admission: every prompt the replicas can run or queue "
        "(replica_num * (max_ragged_sequence_count + max_queued_requests)) plus headroom.",
    )
    restful_api_workers: int | None = _http_workers_field(
        "the REST gateway", "restful_api_port", "; each has restful_api_threads threads"
    )
    enable_openai_api: bool = Field(default=False, description="Start the OpenAI-compatible HTTP server.")
    openai_api_host: str = Field(
        default="127.0.0.1", description="Address the OpenAI-compatible server binds."
    )
    openai_api_port: int = Field(
        default=8000, ge=1, le=65535, description="OpenAI-compatible server's HTTP port."
    )
    openai_api_workers: int | None = _http_workers_field("the OpenAI-compatible server", "openai_api_port")
    served_model_name: str = Field(
        default="",
        description="Model id the OpenAI API lists and accepts; empty means model_name_or_path "
        "('mii-server-demo' for the demo model).",
    )
    api_key_file: str = Field(
        default="",
        description="File of API keys (one per line) the HTTP servers require as 'Authorization: Bearer KEY'; "
        "keys in $MII_SERVER_API_KEY (comma-separated) count too. No key anywhere: no authentication. "
        "Never put a key itself in the config: it travels on command lines.",
    )
    tls_cert_file: str = Field(
        default="",
        description="PEM certificate chain of every gRPC server of the deployment (with tls_key_file: TLS on "
        "every gRPC hop; for deployments that bind beyond loopback). Empty: plaintext.",
    )
    tls_key_file: str = Field(default="", description="PEM private key of tls_cert_file.")
    tls_ca_file: str = Field(
        default="",
        description="PEM certificates the deployment's own gRPC channels trust (the CA of tls_cert_file); "
        "empty with TLS on: the certificate itself.",
    )
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="Origins (scheme://host[:port], or * for any) whose browser apps may call the REST gateway "
        "and the OpenAI server directly (CORS); empty: CORS off.",
    )
    max_request_body_bytes: int = Field(
        default=32 * 2**20,
        ge=1024,
        le=2**27,
        description="Largest HTTP request body the REST gateway and the OpenAI server accept; a larger one is "
        "refused with 413 before it is read whole. At most 128 MiB (a gRPC message's limit).",
    )
    enable_metrics: bool = Field(
        default=True, description="Serve Prometheus /metrics and /health over HTTP from every replica."
    )
    metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Replica i serves /metrics and /health on metrics_port + i; None means the ports right "
        "after the replicas' gRPC ports (port_number + 1 + replica_num * tensor_parallel + i). The REST "
        "gateway and the OpenAI server serve /metrics on their own ports.",
    )
    max_queued_requests: int | None = Field(
        default=1024,
        ge=0,
        description="A replica refuses new requests (gRPC RESOURCE_EXHAUSTED, HTTP 503 with Retry-After) while "
        "this many of its prompts wait for admission; None means unbounded.",
    )
    device_map: DeviceMap = Field(
        default="auto",
        description="GPUs per replica: 'auto' (contiguous groups of tensor_parallel), an int, a list of ints "
        "(one replica), a list of lists (one per replica) or {'localhost': [[...], ...]} as in MII.",
    )
    registry_dir: str = Field(
        default="",
        description="Directory of deployment records; empty means $MII_SERVER_REGISTRY or a per-user default.",
    )
    startup_timeout_s: float = Field(
        default=900.0, gt=0, description="Seconds every process gets to load and answer health."
    )
    replica_wait_s: float = Field(
        default=30.0,
        ge=0,
        description="Seconds a request waits for a replica to come back when every replica is down "
        "(restarting) before it fails with ReplicaUnavailable; 0 fails at once.",
    )
    max_restarts: int = Field(
        default=10,
        ge=0,
        description="Times the supervisor restarts one child that died before giving up on it.",
    )
    stop_grace_s: float | None = Field(
        default=None,
        ge=0,
        description="Seconds a process asked to stop (SIGTERM, Terminate) gives the requests and streams it "
        "carries to finish before it cuts them; None sets no limit of its own (the supervisor's teardown "
        "or Kubernetes' terminationGracePeriodSeconds bounds it). A second SIGTERM cuts at once.",
    )
    log_max_bytes: int = Field(
        default=64 * 2**20,
        ge=0,
        description="Size at which each process's log file (<registry>/logs/<name>/<role>.log) is rotated to "
        "<role>.log.1; 0 never rotates. A process writing to a pod's stdout rotates nothing.",
    )
    log_backups: int = Field(default=5, ge=0, le=1000, description="Rotated logs kept per process (.1 is the newest).")
    replica_stall_timeout_s: float = Field(
        default=20.0,
        gt=0,
        description="Seconds a replica may go without answering its stats, or spend in one engine step, before "
        "it counts as hung: the load balancer fails its requests over (those with no output yet; the others "
        "end with UNAVAILABLE) and the supervisor kills and restarts it.",
    )
    resolve_interval_s: float = Field(
        default=2.0,
        gt=0,
        le=60,
        description="Seconds between the load balancer's re-resolutions of dns:///NAME:PORT replica addresses "
        "(keep it well under the replicas' preStop sleep, so a leaving replica is dropped before it stops).",
    )

    @field_validator("device_map", mode="before")
    @classmethod
    def _device_map_shape(cls, value: Any) -> Any:
        if isinstance(value, dict):
            hosts = set(value)
            if hosts - {"localhost"}:
                raise ValueError(f"device_map names hosts {sorted(hosts)}; only 'localhost' is supported")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        # The default name depends on the model, so it is filled in before field validation.
        if isinstance(data, dict) and not data.get("deployment_name"):
            model = data.get("model")
            path = (
                model.model_name_or_path
                if isinstance(model, ModelConfig)
                else (model or {}).get("model_name_or_path", "")
            )
            data = {**data, "deployment_name": default_deployment_name(path)}
        return data

    @field_validator("deployment_name")
    @classmethod
    def _name_is_safe(cls, name: str) -> str:
        # It becomes a file name in the registry and a path segment of the REST URL.
        if not _NAME_RE.match(name):
            raise ValueError(
                f"deployment_name {name!r} must be 1-128 characters of letters, digits, '.', '_' or '-'"
            )
        return name

    @model_validator(mode="after")
    def _ports_and_devices_agree(self) -> DeploymentConfig:
        top = max([self.port_number, *self.replica_ports, *self.replica_metrics_ports])
        if top > 65535:
            raise ValueError(f"replica ports run past 65535 (port_number={self.port_number})")
        ports = [p for p, _ in self._all_ports()]
        if len(ports) != len(set(ports)):
            raise ValueError(
                f"two processes of the deployment would share a port: {sorted(self._all_ports())}"
            )
        for name in ("restful_api_workers", "openai_api_workers"):
            if (getattr(self, name) or 1) > 1 and not hasattr(socket, "SO_REUSEPORT"):
                raise ValueError(f"{name} > 1 binds one port in several processes (SO_REUSEPORT), "
                                 "which this platform does not offer")  # fmt: skip
        if len(self.gpu_groups) not in (0, self.replica_num):
            raise ValueError(
                f"device_map gives {len(self.gpu_groups)} GPU groups for {self.replica_num} replicas"
            )
        bad = [g for g in self.gpu_groups if len(g) != self.model.tensor_parallel]
        if bad:
            raise ValueError(
                f"device_map groups {bad} do not have tensor_parallel={self.model.tensor_parallel} GPUs"
            )
        gpus = [gpu for group in self.gpu_groups for gpu in group]
        if len(gpus) != len(set(gpus)):
            raise ValueError(f"device_map groups {self.gpu_groups} share GPUs; each replica needs its own")
        return self

    def _all_ports(self) -> list[tuple[int, str]]:
        ports = [(self.port_number, "load balancer")]
        ports += [(p, f"replica {i}") for i, p in enumerate(self.replica_ports)]
        ports += [(p, f"replica {i} metrics") for i, p in enumerate(self.replica_metrics_ports)]
        if self.enable_restful_api:
            ports.append((self.restful_api_port, "REST gateway"))
        if self.enable_openai_api:
            ports.append((self.openai_api_port, "OpenAI-compatible server"))
        return ports

    # ---- derived values -------------------------------------------------------------------
    @property
    def lb_address(self) -> str:
        return f"{self.host}:{self.port_number}"

    @property
    def replica_ports(self) -> list[int]:
        step = self.model.tensor_parallel
        return [self.port_number + 1 + i * step for i in range(self.replica_num)]

    @property
    def replica_addresses(self) -> list[str]:
        return [f"{self.host}:{p}" for p in self.replica_ports]

    @property
    def rest_url(self) -> str | None:
        if not self.enable_restful_api:
            return None
        return f"http://{self.restful_api_host}:{self.restful_api_port}/mii/{self.deployment_name}"

    @property
    def openai_url(self) -> str | None:
        if not self.enable_openai_api:
            return None
        return f"http://{self.openai_api_host}:{self.openai_api_port}/v1"

    def grpc_security(self) -> GrpcSecurity:
        """The supervisor's view of its deployment's gRPC security (its key, its TLS trust)."""
        return GrpcSecurity.load(self.api_key_file, self.tls_cert_file, self.tls_key_file, self.tls_ca_file)

    @property
    def rest_gateway_threads(self) -> int:
        """The REST gateway's thread count: given, or enough for every prompt admission lets in."""
        if self.restful_api_threads is not None:
            return self.restful_api_threads
        queued = self.max_queued_requests if self.max_queued_requests is not None else UNBOUNDED_QUEUE_THREADS
        per_replica = self.model.max_ragged_sequence_count + queued
        return min(MAX_REST_THREADS, self.replica_num * per_replica + REST_THREAD_HEADROOM)

    @property
    def rest_gateway_workers(self) -> int:
        """The REST gateway's process count: given, or the default bounded by this machine's cores."""
        return _http_workers(self.restful_api_workers)

    @property
    def openai_server_workers(self) -> int:
        """The OpenAI server's process count: given, or the default bounded by this machine's cores."""
        return _http_workers(self.openai_api_workers)

    @property
    def served_model(self) -> str:
        """The model id of the OpenAI API."""
        return self.served_model_name or self.model.model_name_or_path or "mii-server-demo"

    @property
    def replica_metrics_ports(self) -> list[int]:
        """HTTP port of each replica's /metrics and /health (empty when metrics are off)."""
        if not self.enable_metrics:
            return []
        base = self.metrics_port
        if base is None:
            base = self.port_number + 1 + self.replica_num * self.model.tensor_parallel
        return [base + i for i in range(self.replica_num)]

    @property
    def gpu_groups(self) -> list[list[int]]:
        """Explicit GPU indices per replica; empty for 'auto' (the supervisor decides at launch)."""
        dm = self.device_map
        if dm == "auto":
            return []
        if isinstance(dm, int):
            return [[dm]]
        if isinstance(dm, dict):
            return [list(g) for g in dm.get("localhost", [])]
        if dm and all(isinstance(x, int) for x in dm):
            return [list(dm)]  # type: ignore[arg-type]
        return [list(g) for g in dm]  # type: ignore[union-attr]

    def ports_in_use_by_deployment(self) -> dict[int, str]:
        """Every TCP port this deployment listens on, with what listens there."""
        return {port: what for port, (_, what) in self.listen_addresses().items()}

    def listen_addresses(self) -> dict[int, tuple[str, str]]:
        """Every TCP port this deployment listens on: (bind host, what listens there)."""
        hosts = {"REST gateway": self.restful_api_host, "OpenAI-compatible server": self.openai_api_host}
        return {port: (hosts.get(what, self.host), what) for port, what in self._all_ports()}

    # ---- construction from kwargs -------------------------------------------------------------
    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(cls.model_fields) - {"model"}

    @classmethod
    def from_kwargs(cls, model_name_or_path: str = "", **kwargs: Any) -> DeploymentConfig:
        """Split ``serve()`` kwargs between ModelConfig and this config.

        ``UnknownArgument`` for names neither accepts, ``InvalidRequest`` for bad values.
        """
        model_name_or_path, kwargs = merge_mii_config_dicts(model_name_or_path, kwargs)
        model_keys = ModelConfig.field_names() - {"model_name_or_path"}
        unknown = sorted(set(kwargs) - model_keys - cls.field_names())
        if unknown:
            raise UnknownArgument(
                f"Keyword argument(s) {', '.join(unknown)} not recognized; serve() accepts "
                f"{', '.join(sorted(model_keys | cls.field_names()))}"
            )
        model_kwargs = {k: v for k, v in kwargs.items() if k in model_keys}
        own = {k: v for k, v in kwargs.items() if k not in model_keys}
        model = ModelConfig.from_kwargs(model_name_or_path, **model_kwargs)
        try:
            return cls.model_validate({"model": model, **own})
        except ValidationError as err:
            raise InvalidRequest(f"invalid deployment configuration: {err}") from None


def default_deployment_name(model_name_or_path: str) -> str:
    """MII's rule: '<basename>-mii-deployment'; the demo model gets 'mii-server-demo-mii-deployment'."""
    if not model_name_or_path:
        return "mii-server-demo-mii-deployment"
    base = os.path.basename(model_name_or_path.rstrip("/")) or "model"
    base = re.sub(r"[^A-Za-z0-9._-]", "-", base)
    return f"{base}-mii-deployment"
