"""Unit: the role configs (from a deployment, as the supervisor derives them, and from the role
subcommands' flags and config file) and the CLI flags derived from the config fields."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mii_server import cli
from mii_server.config import ModelConfig
from mii_server.errors import InvalidRequest, UnknownArgument
from mii_server.serving.control.deployment import DeploymentConfig
from mii_server.serving.control.roles import GatewayRole, LoadBalancerRole, ReplicaRole


def _parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


def _options(command: str) -> set[str]:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {s for action in sub.choices[command]._actions for s in action.option_strings}


def test_the_supervisor_derives_each_role_from_its_deployment(tmp_path: Path) -> None:
    cfg = DeploymentConfig.from_kwargs(
        "/m", replica_num=2, tensor_parallel=2, port_number=7000, max_queued_requests=5, registry_dir=str(tmp_path),
        enable_openai_api=True, openai_api_host="0.0.0.0", openai_api_port=7100, served_model_name="m",
        restful_api_workers=1, openai_api_workers=1,
    )  # fmt: skip
    replica = ReplicaRole.of_deployment(cfg, 1)
    assert (replica.port, replica.metrics_port, replica.replica_index) == (cfg.replica_ports[1], cfg.replica_metrics_ports[1], 1)
    assert replica.model == cfg.model and replica.max_queued_requests == 5 and replica.address == cfg.replica_addresses[1]
    assert Path(replica.rank_log_dir).is_dir()  # the ranks log beside the supervisor's other logs
    lb = LoadBalancerRole.of_deployment(cfg)
    assert (lb.address, lb.replicas, lb.replica_wait_s) == (cfg.lb_address, cfg.replica_addresses, cfg.replica_wait_s)
    openai = GatewayRole.of_deployment(cfg, "openai")
    assert (openai.host, openai.openai_port, openai.rest_port, openai.load_balancer) == ("0.0.0.0", 7100, None, cfg.lb_address)
    assert not openai.openai_shared_port
    rest = GatewayRole.of_deployment(cfg, "rest")
    assert (rest.host, rest.rest_port, rest.rest_threads, rest.served_model) == (
        cfg.restful_api_host, cfg.restful_api_port, cfg.rest_gateway_threads, "m"
    )  # fmt: skip
    assert not rest.rest_shared_port  # this machine's default, or one process asked for: a plain bind
    shared = DeploymentConfig.from_kwargs("/m", enable_restful_api=True, restful_api_workers=3,
                                          enable_openai_api=True, openai_api_workers=2)  # fmt: skip
    assert GatewayRole.of_deployment(shared, "rest").rest_shared_port
    assert GatewayRole.of_deployment(shared, "openai").openai_shared_port
    no_metrics = DeploymentConfig.from_kwargs("", enable_metrics=False)
    assert ReplicaRole.of_deployment(no_metrics, 0).metrics_port is None


def test_a_replica_pod_takes_its_layout_from_flags_and_the_rest_from_the_config(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "deployment_name": "pod", "max_queued_requests": 7,
        "model_config": {"device": "cpu", "max_length": 100, "kv_cache": {"block_size": 32}},
    }))  # fmt: skip
    args = _parse(
        "replica", "--config", str(config), "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9090",
        "--tensor-parallel", "2", "--max-length", "200", "--kv-cache-num-blocks", "64", "--no-cuda-graphs",
    )  # fmt: skip
    role = cli.role_config(args)
    assert isinstance(role, ReplicaRole)
    assert (role.host, role.port, role.metrics_port, role.deployment_name, role.max_queued_requests) == (
        "0.0.0.0", 50051, 9090, "pod", 7
    )  # fmt: skip
    m = role.model
    assert (m.model_name_or_path, m.device, m.tensor_parallel, m.max_length, m.cuda_graphs) == ("", "cpu", 2, 200, False)
    assert (m.kv_cache.block_size, m.kv_cache.num_blocks) == (32, 64)  # the file's and the flag's, merged
    assert role.rank_log_dir == ""  # the ranks write to the pod's stderr
    assert cli.role_config(_parse("replica", "/models/m", "--config", str(config))).model.model_name_or_path == "/models/m"


def test_every_model_field_is_a_replica_and_serve_flag() -> None:
    derived = {"--" + n.replace("_", "-") for n in ModelConfig.model_fields if n not in ("model_name_or_path", "kv_cache")}
    derived |= {"--kv-cache-" + n.replace("_", "-") for n in ModelConfig.model_fields["kv_cache"].annotation.model_fields}
    assert derived <= _options("replica") and derived <= _options("serve")
    assert {"--no-cuda-graphs", "--no-overlap-scheduling"} <= _options("replica")
    assert {"--host", "--port", "--metrics-port", "--config"} <= _options("replica")


def test_the_serve_flags_of_before_still_mean_the_same() -> None:
    args = _parse(
        "serve", "/m", "--deployment-name", "d", "--replica-num", "2", "--tensor-parallel", "1", "--host", "0.0.0.0",
        "--port", "6000", "--rest", "--rest-port", "6100", "--rest-host", "0.0.0.0", "--openai-port", "6200",
        "--openai-host", "0.0.0.0", "--served-model-name", "sm", "--api-key-file", "/k", "--metrics-port", "6300",
        "--no-metrics", "--max-length", "64", "--dtype", "float32", "--device", "cpu", "--device-map", "[[0], [1]]",
        "--registry", "/r",
    )  # fmt: skip
    cfg = cli.deployment_config(args)
    assert (cfg.deployment_name, cfg.replica_num, cfg.host, cfg.port_number) == ("d", 2, "0.0.0.0", 6000)
    assert (cfg.enable_restful_api, cfg.restful_api_port, cfg.restful_api_host) == (True, 6100, "0.0.0.0")
    assert (cfg.enable_openai_api, cfg.openai_api_port, cfg.openai_api_host) == (True, 6200, "0.0.0.0")
    assert (cfg.served_model_name, cfg.api_key_file, cfg.metrics_port, cfg.enable_metrics) == ("sm", "/k", 6300, False)
    assert (cfg.model.max_length, cfg.model.dtype, cfg.model.device, cfg.device_map) == (64, "float32", "cpu", [[0], [1]])
    assert cfg.registry_dir == "/r" and cfg.model.model_name_or_path == "/m"
    plain = cli.deployment_config(_parse("serve"))
    assert plain == DeploymentConfig.from_kwargs("")  # no flag: every default is the config's own
    assert cli.deployment_config(_parse("serve", "--max-queued-requests", "none")).max_queued_requests is None


def test_load_balancer_and_gateway_pods(tmp_path: Path) -> None:
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"deployment_name": "x", "served_model_name": "sm", "replica_wait_s": 3}))
    lb = cli.role_config(_parse("load-balancer", "--config", str(config), "--replicas", "dns:///r:50051,10.0.0.1:9"))
    assert isinstance(lb, LoadBalancerRole)
    assert (lb.replicas, lb.replica_wait_s, lb.port) == (["dns:///r:50051", "10.0.0.1:9"], 3, 50050)
    with pytest.raises(InvalidRequest, match="replica address"):
        cli.role_config(_parse("load-balancer", "--replicas", "dns:///r"))
    with pytest.raises(SystemExit):  # --replicas is required: the field has no default
        _parse("load-balancer")
    gw = cli.role_config(_parse("gateway", "--config", str(config), "--load-balancer", "lb:1", "--rest-port", "2", "--openai-port", "3"))
    assert isinstance(gw, GatewayRole)
    assert (gw.load_balancer, gw.rest_port, gw.openai_port, gw.served_model, gw.deployment_name) == ("lb:1", 2, 3, "sm", "x")
    with pytest.raises(InvalidRequest, match="rest_port"):
        cli.role_config(_parse("gateway"))


def test_bad_config_files_are_refused_clearly(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(InvalidRequest, match="JSON object"):
        cli.role_config(_parse("gateway", "--config", str(bad), "--rest-port", "1"))
    bad.write_text("{not json")
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        cli.deployment_config(_parse("serve", "--config", str(bad)))
    bad.write_text(json.dumps({"max_lenght": 5}))
    with pytest.raises(UnknownArgument, match="max_lenght"):
        cli.deployment_config(_parse("serve", "--config", str(bad)))
    with pytest.raises(InvalidRequest, match="nowhere.json"):
        cli.deployment_config(_parse("serve", "--config", str(tmp_path / "nowhere.json")))
