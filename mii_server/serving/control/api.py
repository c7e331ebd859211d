"""``serve()`` and ``client()``: stand up a deployment, or find a running one."""

from __future__ import annotations

import os
import time
from typing import Any

from ...errors import DeploymentNotFound, DeploymentStartError, InvalidRequest
from ...launch import process
from ...launch.log_rotation import rotation_env
from ...launch.spec import LaunchSpec
from ..frontends.client import Client
from ..security import ADMIN_TOKEN_ENV, ApiKeys, new_admin_token
from . import devices, ports, registry
from .deployment import DeploymentConfig, default_deployment_name

POLL_S = 0.05


def serve(model_name_or_path: str = "", **kwargs: Any) -> Client:
    """Start a deployment in the background and return a ``Client`` once every process is serving.

    Kwargs are MII's: ``ModelConfig`` fields (``tensor_parallel``, ``max_length``, ``dtype``, ...) and
    ``DeploymentConfig`` fields (``deployment_name``, ``replica_num``, ``port_number``,
    ``enable_restful_api``, ``restful_api_port``, ``enable_openai_api``, ``openai_api_port``, ``device_map``,
    ``metrics_port``, ...). Unknown names raise
    ``UnknownArgument`` and a port in use raises ``DeploymentStartError``, before anything starts.
    The deployment outlives this script; stop it with ``client.terminate_server()`` or
    ``mii-server stop NAME``. A process that dies while starting raises ``DeploymentStartError``
    carrying the tail of its log.
    """
    config = prepare(DeploymentConfig.from_kwargs(model_name_or_path, **kwargs))
    name, directory = config.deployment_name, config.registry_dir
    log_path = registry.log_dir(name, directory) / "supervisor.log"
    # the deployment's admin token: to its processes by environment, never argv; kept in the owner-only record
    token = os.environ.get(ADMIN_TOKEN_ENV) or new_admin_token()
    env = {**os.environ, ADMIN_TOKEN_ENV: token, **rotation_env(config.log_max_bytes, config.log_backups)}
    proc = process.spawn("supervisor", LaunchSpec(deployment=config), log_path, detach=True, env=env)
    deadline = time.monotonic() + config.startup_timeout_s + 60.0
    while True:
        record = registry.read(name, directory)
        if record is not None and record.supervisor_pid == proc.pid:
            if record.state == "ready":
                return Client(config.lb_address, deployment_name=name, supervisor=proc, admin_token=token,
                              api_key=ApiKeys.load(config.api_key_file).first,
                              tls_ca_file=config.tls_ca_file or config.tls_cert_file)  # fmt: skip
            if record.state == "failed":
                proc.wait()
                registry.remove(name, directory, only_pid=proc.pid)
                raise DeploymentStartError(record.error)
        code = proc.poll()
        if code is not None:
            record = registry.read(name, directory)
            registry.remove(name, directory, only_pid=proc.pid)
            if record is not None and record.supervisor_pid == proc.pid and record.error:
                raise DeploymentStartError(record.error)
            raise DeploymentStartError(
                f"the supervisor of {name} exited with status {code}; last lines of {log_path}:\n"
                f"{process.log_tail(log_path)}"
            )
        if time.monotonic() > deadline:
            process.stop_group(proc)
            raise DeploymentStartError(f"deployment {name} was not ready in time; see {log_path}")
        time.sleep(POLL_S)  # polling the record for a state change, bounded by the deadline


def prepare(config: DeploymentConfig) -> DeploymentConfig:
    """Check what can be checked before any process starts (GPUs, name, ports); returns the config
    with its registry directory resolved, so every process of the deployment agrees on it."""
    config = config.model_copy(update={"registry_dir": str(registry.registry_dir(config.registry_dir))})
    try:  # more GPUs than visible is the caller's error
        devices.replica_gpus(config.replica_num, config.model.tensor_parallel, config.gpu_groups, config.model.device)
    except ValueError as err:
        raise InvalidRequest(str(err)) from None
    claim_name(config.deployment_name, config.registry_dir)
    ports.ensure_deployment_ports_free(config.listen_addresses())
    return config


def claim_name(name: str, directory: str = "") -> None:
    """Fail if a live deployment holds ``name``; drop a stale record left by a dead one."""
    existing = registry.read(name, directory)
    if existing is None:
        return
    if existing.is_alive():
        raise DeploymentStartError(
            f"a deployment named {name!r} is already running (supervisor pid {existing.supervisor_pid}, "
            f"load balancer {existing.address}); stop it with `mii-server stop {name}` or pick another "
            "deployment_name"
        )
    registry.remove(name, directory)


def client(
    deployment_name_or_host_port: str = "", timeout: float | None = None, api_key: str | None = None
) -> Client:
    """A ``Client`` for a running deployment, by registry name (any process of this user) or ``host:port``.

    An empty name means the demo model's default deployment name. Like MII, a model name is also
    tried as ``<name>-mii-deployment``. Raises ``DeploymentNotFound`` when nothing matches.
    """
    target = deployment_name_or_host_port or default_deployment_name("")
    for name in (target, default_deployment_name(target)):
        record = registry.read(name) if "/" not in name else None
        if record is None:
            continue
        if not record.is_alive():
            registry.remove(name, only_pid=record.supervisor_pid)
            continue
        if record.state != "ready":
            raise DeploymentNotFound(f"deployment {name!r} is {record.state}, not ready")
        return Client(
            record.address, deployment_name=name, timeout=timeout, supervisor_pid=record.supervisor_pid,
            api_key=api_key, admin_token=record.admin_token, tls_ca_file=record.tls_ca_file,
        )  # fmt: skip
    host, sep, port = target.rpartition(":")
    if sep and host and port.isdigit():
        return Client(target, timeout=timeout, api_key=api_key, admin_token=os.environ.get(ADMIN_TOKEN_ENV, ""))
    raise DeploymentNotFound(
        f"no running deployment named {target!r} in {registry.registry_dir()} "
        f"(set {registry.ENV_VAR} if it was started with another registry), and it is not host:port"
    )
