"""The supervisor: starts every process of a deployment, waits until all answer health, restarts
what dies (and, through its watchdog, kills and restarts a replica that hangs), and tears everything
down on terminate.

Protocol with its children: a child that exits with status 0 was told to stop (Terminate RPC or
SIGTERM) and is not restarted; the load balancer exiting with 0 means the deployment was terminated,
so the supervisor stops the rest, removes the registry record and exits. Any other exit is a crash:
during start-up it fails the whole deployment (with that child's log tail), afterwards the child is
restarted (up to ``max_restarts`` times).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ...errors import DeploymentStartError
from ...launch import process
from ...launch.log_rotation import rotation_env
from ...launch.spec import LaunchSpec, Role
from .. import grpc_common
from ..metrics import MULTIPROCESS_DIR_ENV
from ..security import ADMIN_TOKEN_ENV
from . import devices, registry
from .deployment import DeploymentConfig
from .watchdog import ReplicaWatchdog

log = logging.getLogger(__name__)

POLL_S = 0.2
STOP_GRACE_S = 15.0


@dataclass
class Child:
    """One supervised process."""

    role: Role
    index: int | None  # replica index, or an HTTP front end's process index when it has several; else None
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    stopped: bool = False  # exited with 0 on request: not restarted

    @property
    def label(self) -> str:
        name = self.role.replace("-", " ")
        return name if self.index is None else f"{name} {self.index}"


class Supervisor:
    """Owns the process tree of one deployment. ``run()`` blocks until the deployment is gone."""

    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.stop = threading.Event()
        self.log_dir = registry.log_dir(config.deployment_name, config.registry_dir)
        self.children = self._plan()

    def _plan(self) -> list[Child]:
        cfg = self.config
        gpus = devices.replica_gpus(cfg.replica_num, cfg.model.tensor_parallel, cfg.gpu_groups, cfg.model.device)
        base_env = {**os.environ, **rotation_env(cfg.log_max_bytes, cfg.log_backups)}
        base_env.pop(MULTIPROCESS_DIR_ENV, None)  # only the HTTP front ends' processes pool their metrics
        children = []
        for i in range(cfg.replica_num):
            env = dict(base_env)
            if gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i])
            children.append(Child("replica", i, self.log_dir / f"replica-{i}.log", env))
        children.append(Child("load-balancer", None, self.log_dir / "load-balancer.log", dict(base_env)))
        if cfg.enable_restful_api:
            children += self._shared_port_children("rest-gateway", cfg.rest_gateway_workers, base_env)
        if cfg.enable_openai_api:
            children += self._shared_port_children("openai-server", cfg.openai_server_workers, base_env)
        return children

    def _shared_port_children(self, role: str, workers: int, base_env: dict[str, str]) -> list[Child]:
        """The processes of one HTTP front end on one port. They count their HTTP metrics in files of
        one directory, emptied here (what a previous deployment of this name counted is not ours), so
        that a scrape reaching any of them answers for all, and a restarted one's counts are kept."""
        metrics_dir = self.log_dir / f"{role}-metrics"
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(parents=True)
        env = {**base_env, MULTIPROCESS_DIR_ENV: str(metrics_dir)}
        if workers == 1:  # the log keeps its name of before
            return [Child(role, None, self.log_dir / f"{role}.log", env)]
        return [Child(role, k, self.log_dir / f"{role}-{k}.log", env) for k in range(workers)]

    # ---- lifecycle --------------------------------------------------------------------------
    def run(self) -> int:
        """Start, wait until ready, watch, tear down. Returns the process exit status."""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: self.stop.set())
        self._write_record("starting")
        try:
            for child in self.children:
                self._spawn(child)
            self._wait_ready()
        except DeploymentStartError as err:
            log.error("%s", err)
            self._teardown()
            self._write_record("failed", error=str(err))
            return 1
        if self.stop.is_set():
            self._teardown()
            registry.remove(self.config.deployment_name, self.config.registry_dir, only_pid=os.getpid())
            return 0
        self._write_record("ready")
        log.info(
            "deployment %s ready: load balancer at %s", self.config.deployment_name, self.config.lb_address
        )
        watchdog = ReplicaWatchdog(
            self._serving_replicas, self.config.replica_stall_timeout_s, self.stop, self.config.grpc_security()
        )
        for _, pid in self._serving_replicas():
            watchdog.arm(pid)  # every replica answered health just now
        watchdog.start()
        self._watch()
        self._write_record("stopping")
        self._teardown()
        registry.remove(self.config.deployment_name, self.config.registry_dir, only_pid=os.getpid())
        log.info("deployment %s stopped", self.config.deployment_name)
        return 0

    def _serving_replicas(self) -> list[tuple[str, int]]:
        """(address, pid) of every replica process running now (what the watchdog looks at)."""
        return [
            (self.config.replica_addresses[c.index], c.proc.pid)
            for c in self.children
            if c.role == "replica" and c.proc is not None and c.proc.poll() is None
        ]

    def _spawn(self, child: Child) -> None:
        spec = LaunchSpec(deployment=self.config, replica_index=child.index if child.role == "replica" else None)
        child.proc = process.spawn(child.role, spec, child.log_path, detach=False, env=child.env)
        log.info("started %s (pid %d), log %s", child.label, child.proc.pid, child.log_path)

    def _wait_ready(self) -> None:
        """Return once every child answers health; raise ``DeploymentStartError`` if one dies first."""
        cfg = self.config
        deadline = time.monotonic() + cfg.startup_timeout_s
        channels = {}
        security = cfg.grpc_security()
        for child in self.children:
            if child.role == "replica":
                channels[id(child)] = grpc_common.security_channel(cfg.replica_addresses[child.index], security)
            elif child.role == "load-balancer":
                channels[id(child)] = grpc_common.security_channel(cfg.lb_address, security)
        waiting = list(self.children)
        try:
            while waiting and not self.stop.is_set():
                for child in list(waiting):
                    code = child.proc.poll()
                    if code is not None:
                        raise DeploymentStartError(
                            f"{child.label} of deployment {cfg.deployment_name} exited with status {code} "
                            f"during start-up; last lines of {child.log_path}:\n{process.log_tail(child.log_path)}"
                        )
                    if self._answers(child, channels.get(id(child))):
                        log.info("%s is serving", child.label)
                        waiting.remove(child)
                if time.monotonic() > deadline:
                    names = ", ".join(c.label for c in waiting)
                    tails = "\n".join(
                        f"--- {c.log_path}:\n{process.log_tail(c.log_path, 15)}" for c in waiting
                    )
                    raise DeploymentStartError(
                        f"{names} did not answer health within {cfg.startup_timeout_s:.0f}s\n{tails}"
                    )
                if waiting:
                    self.stop.wait(POLL_S)
        finally:
            for ch in channels.values():
                ch.close()

    def _answers(self, child: Child, channel) -> bool:
        if child.role == "load-balancer":  # ready once it routes to every replica, not just one
            return grpc_common.is_serving(channel, timeout=1.0, service=grpc_common.ALL_REPLICAS_SERVICE)
        if channel is not None:  # a replica: ready once its model has loaded, not merely listening
            return grpc_common.is_serving(channel, timeout=1.0, service=grpc_common.SERVICE_NAME)
        cfg = self.config
        if child.role == "openai-server":
            url = f"http://{cfg.openai_api_host}:{cfg.openai_api_port}/healthz"
        else:
            url = f"http://{cfg.restful_api_host}:{cfg.restful_api_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _watch(self) -> None:
        """Restart crashed children until terminate (load balancer exits 0) or a signal."""
        while not self.stop.wait(POLL_S):
            for child in self.children:
                code = child.proc.poll() if child.proc is not None else None
                if code is None or child.stopped:
                    continue
                if code == 0:
                    child.stopped = True
                    log.info("%s stopped on request", child.label)
                    if child.role == "load-balancer":
                        self.stop.set()  # Terminate reached the load balancer: the deployment ends
                    continue
                if child.restarts >= self.config.max_restarts:
                    child.stopped = True
                    log.error(
                        "%s died with status %d and was restarted %d times; giving up on it",
                        child.label,
                        code,
                        child.restarts,
                    )
                    continue
                child.restarts += 1
                log.warning(
                    "%s died with status %d; restarting (%d/%d); log tail:\n%s",
                    child.label,
                    code,
                    child.restarts,
                    self.config.max_restarts,
                    process.log_tail(child.log_path, 10),
                )
                self._spawn(child)

    def _teardown(self) -> None:
        """SIGTERM every live child, SIGKILL the ones still alive after a grace period, reap all."""
        live = [c.proc for c in self.children if c.proc is not None and c.proc.poll() is None]
        for proc in live:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("pid %d ignored SIGTERM; killing it", proc.pid)
                _signal(proc, signal.SIGKILL)
                proc.wait()

    def _write_record(self, state: registry.State, error: str = "") -> None:
        cfg = self.config
        registry.write(
            registry.DeploymentRecord(
                name=cfg.deployment_name,
                state=state,
                supervisor_pid=os.getpid(),
                address=cfg.lb_address,
                replica_addresses=cfg.replica_addresses,
                rest_url=cfg.rest_url,
                openai_url=cfg.openai_url,
                admin_token=os.environ.get(ADMIN_TOKEN_ENV, ""),
                tls_ca_file=cfg.tls_ca_file or cfg.tls_cert_file,
                log_dir=str(self.log_dir),
                model=cfg.model.model_name_or_path,
                error=error,
            ),
            cfg.registry_dir,
        )


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        # each child leads its own session; signal the group so helpers it started (TP ranks) go too
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        proc.send_signal(sig)
