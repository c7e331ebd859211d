"""Unit: serve()'s kwargs split between ModelConfig and DeploymentConfig; derived ports; strictness."""

from __future__ import annotations

import pytest

from mii_server.errors import InvalidRequest, UnknownArgument
from mii_server.launch.spec import LaunchSpec, command, decode, encode
from mii_server.serving.control.deployment import DeploymentConfig


def test_mii_defaults_and_derived_ports() -> None:
    cfg = DeploymentConfig.from_kwargs("", replica_num=3, enable_restful_api=True)
    assert cfg.port_number == 50050 and cfg.restful_api_port == 28080
    assert cfg.replica_ports == [50051, 50052, 50053]
    assert cfg.deployment_name == "mii-server-demo-mii-deployment"
    assert cfg.rest_url == "http://127.0.0.1:28080/mii/mii-server-demo-mii-deployment"
    assert cfg.ports_in_use_by_deployment() == {
        50050: "load balancer",
        50051: "replica 0",
        50052: "replica 1",
        50053: "replica 2",
        50054: "replica 0 metrics",
        50055: "replica 1 metrics",
        50056: "replica 2 metrics",
        28080: "REST gateway",
    }


def test_openai_and_metrics_ports() -> None:
    cfg = DeploymentConfig.from_kwargs("", replica_num=2, enable_openai_api=True, metrics_port=9100)
    assert cfg.openai_url == "http://127.0.0.1:8000/v1"
    assert cfg.replica_metrics_ports == [9100, 9101]
    assert cfg.served_model == "mii-server-demo"
    assert DeploymentConfig.from_kwargs("", enable_metrics=False).replica_metrics_ports == []
    with pytest.raises(InvalidRequest, match="share a port"):
        DeploymentConfig.from_kwargs("", enable_openai_api=True, openai_api_port=50051)


def test_kwargs_are_split_between_model_and_deployment() -> None:
    cfg = DeploymentConfig.from_kwargs(
        "/models/llama-7b/",
        max_length=256,
        tensor_parallel=2,
        replica_num=2,
        port_number=6000,
        deployment_name="mine",
    )
    assert cfg.model.max_length == 256 and cfg.model.tensor_parallel == 2
    assert cfg.model.model_name_or_path == "/models/llama-7b/"
    assert cfg.replica_ports == [6001, 6003]  # one port per rank reserved, as MII does
    assert cfg.deployment_name == "mine"
    assert DeploymentConfig.from_kwargs("/models/llama-7b/").deployment_name == "llama-7b-mii-deployment"


def test_unknown_and_bad_kwargs() -> None:
    with pytest.raises(UnknownArgument, match="replicas"):
        DeploymentConfig.from_kwargs("", replicas=2)
    with pytest.raises(InvalidRequest, match="replica_num"):
        DeploymentConfig.from_kwargs("", replica_num=0)
    with pytest.raises(InvalidRequest, match="deployment_name"):
        DeploymentConfig.from_kwargs("", deployment_name="../etc")
    with pytest.raises(InvalidRequest, match="65535"):
        DeploymentConfig.from_kwargs("", port_number=65535, replica_num=2)


def test_device_map_forms() -> None:
    assert DeploymentConfig.from_kwargs("", device_map=3).gpu_groups == [[3]]
    assert DeploymentConfig.from_kwargs("", device_map=[0, 1], tensor_parallel=2).gpu_groups == [[0, 1]]
    assert DeploymentConfig.from_kwargs("", device_map=[[0], [1]], replica_num=2).gpu_groups == [[0], [1]]
    assert DeploymentConfig.from_kwargs("", device_map={"localhost": [[2]]}).gpu_groups == [[2]]
    with pytest.raises(InvalidRequest, match="GPU groups"):
        DeploymentConfig.from_kwargs("", device_map=[[0]], replica_num=2)
    with pytest.raises(InvalidRequest, match="localhost"):
        DeploymentConfig.from_kwargs("", device_map={"node7": [[0]]})


def test_launch_spec_travels_as_urlsafe_base64_json() -> None:
    spec = LaunchSpec(deployment=DeploymentConfig.from_kwargs("", replica_num=2), replica_index=1)
    text = encode(spec)
    assert set(text) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_=")
    assert decode("replica", text) == spec
    argv = command("replica", spec)
    assert argv[1:5] == ["-m", "mii_server.launch", "--role", "replica"] and argv[5] == "--config"


def test_mii_config_dicts_are_accepted_and_merged() -> None:
    cfg = DeploymentConfig.from_kwargs(
        "", model_config={"model_name_or_path": "/m", "max_length": 100},
        mii_config={"replica_num": 2, "deployment_name": "mii-style", "model_config": {"dtype": "float32"}},
    )  # fmt: skip
    assert (cfg.model.model_name_or_path, cfg.model.max_length, cfg.model.dtype) == ("/m", 100, "float32")
    assert (cfg.replica_num, cfg.deployment_name) == (2, "mii-style")
    with pytest.raises(InvalidRequest, match="given twice"):
        DeploymentConfig.from_kwargs("", model_config={"max_length": 5}, max_length=6)
    with pytest.raises(InvalidRequest, match="disagrees"):
        DeploymentConfig.from_kwargs("/a", model_config={"model_name_or_path": "/b"})
    quantized = DeploymentConfig.from_kwargs("", model_config={"quantization_mode": "wf6af16"})
    assert quantized.model.quantization_mode == "wf6af16"
    with pytest.raises(UnknownArgument, match="load_with_sys_mem"):
        DeploymentConfig.from_kwargs("", model_config={"load_with_sys_mem": True})


@pytest.mark.parametrize(("kwarg", "workers"), [("restful_api_workers", "rest_gateway_workers"),
                                                ("openai_api_workers", "openai_server_workers")])  # fmt: skip
def test_http_front_end_workers_default_to_the_cores_there_are(monkeypatch: pytest.MonkeyPatch, kwarg, workers) -> None:
    from mii_server.serving.control import deployment

    for cores, expected in ((1, 1), (2, 1), (8, 2), (16, 4), (128, deployment.DEFAULT_HTTP_WORKERS)):
        monkeypatch.setattr(deployment, "usable_cores", lambda n=cores: n)
        assert getattr(DeploymentConfig.from_kwargs(""), workers) == expected, cores
    assert getattr(DeploymentConfig.from_kwargs("", **{kwarg: 3}), workers) == 3
    with pytest.raises(InvalidRequest, match=kwarg):
        DeploymentConfig.from_kwargs("", **{kwarg: 0})
