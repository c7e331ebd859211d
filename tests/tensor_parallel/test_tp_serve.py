"""serve(tensor_parallel=2, replica_num=2): four ranks, two replicas, the same greedy text; no orphans."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from server.helpers import deployment_processes, free_port_block, listening_addresses, wait_for

import mii_server
from mii_server.errors import InvalidRequest, MIIServerError
from mii_server.serving.control import registry

pytestmark = pytest.mark.integration

PROMPTS = [f"prompt {i}: the quick brown fox" for i in range(6)]


def test_tp2_two_replicas_serve_and_terminate(tiny_checkpoints: dict[str, Path]) -> None:
    path = str(tiny_checkpoints["llama3"])
    pipe = mii_server.pipeline(path)
    expected = [r.token_ids for r in pipe(PROMPTS, max_new_tokens=12, do_sample=False, ignore_eos=True)]
    pipe.destroy()

    name = "tp-serve-test"
    base = free_port_block(8)
    client = mii_server.serve(path, deployment_name=name, tensor_parallel=2, replica_num=2, port_number=base)
    registry_dir = str(registry.registry_dir())
    try:
        out = client.generate(PROMPTS, max_new_tokens=12, do_sample=False, ignore_eos=True)
        assert [r.token_ids for r in out] == expected
        stats = client.stats()
        assert all(r.healthy and r.prompts_received == 3 for r in stats), stats  # both replicas served
        pids = deployment_processes(name, registry_dir)
        roles = sorted(_role(pid) for pid in pids)
        assert roles == ["load-balancer", "replica", "replica", "replica-rank", "replica-rank", "supervisor"]
        # every socket of the deployment, the ranks' rendezvous store and step channel included,
        # listens on the loopback address it was given, none on every interface
        listening = listening_addresses(pids)
        assert len(listening) >= 7, listening  # LB, 2 replicas, 2 metrics, 2 stores, 2 step channels
        assert {address for address, _ in listening} == {"127.0.0.1"}, listening
    finally:
        client.terminate_server()
    wait_for(lambda: not deployment_processes(name, registry_dir), 60, "every rank to exit")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_served_at_tp2_equals_one_process(family: str, tiny_checkpoints: dict[str, Path]) -> None:
    """Experts split like MLPs across the ranks of a served replica give one process's greedy tokens."""
    path = str(tiny_checkpoints[family])
    pipe = mii_server.pipeline(path)
    expected = [r.token_ids for r in pipe(PROMPTS[:3], max_new_tokens=8, do_sample=False, ignore_eos=True)]
    pipe.destroy()
    client = mii_server.serve(path, deployment_name=f"tp-{family}", tensor_parallel=2, port_number=free_port_block(4))
    try:
        out = client.generate(PROMPTS[:3], max_new_tokens=8, do_sample=False, ignore_eos=True)
        assert [r.token_ids for r in out] == expected
    finally:
        client.terminate_server()


def test_a_follower_killed_restarts_the_replica(tiny_checkpoints: dict[str, Path]) -> None:
    path = str(tiny_checkpoints["llama"])
    name = "tp-restart-test"
    base = free_port_block(4)
    client = mii_server.serve(path, deployment_name=name, tensor_parallel=2, port_number=base)
    registry_dir = str(registry.registry_dir())
    try:
        before = client.generate(["hello"], max_new_tokens=6, do_sample=False, ignore_eos=True)
        followers = [pid for pid in deployment_processes(name, registry_dir) if _role(pid) == "replica-rank"]
        assert len(followers) == 1
        os.kill(followers[0], signal.SIGKILL)
        wait_for(
            lambda: [p for p in deployment_processes(name, registry_dir) if _role(p) == "replica-rank"]
            not in ([], followers),
            120,
            "a new follower rank",
        )

        def serves_again() -> bool:
            try:
                return client.generate(["hello"], max_new_tokens=6, do_sample=False, ignore_eos=True) == before
            except MIIServerError:  # still restarting: unavailable, or the engine not loaded yet
                return False

        wait_for(serves_again, 120, "the restarted replica to serve", interval=0.5)
    finally:
        client.terminate_server()
    wait_for(lambda: not deployment_processes(name, registry_dir), 60, "every rank to exit")


def _role(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return argv[argv.index(b"--role") + 1].decode() if b"--role" in argv else ""


def test_more_gpus_than_visible_is_an_error_at_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(InvalidRequest, match="need 4 GPUs, but 2 are visible"):
        mii_server.serve(tensor_parallel=2, replica_num=2, deployment_name="too-many-gpus")


def test_device_map_groups_must_be_disjoint() -> None:
    with pytest.raises(InvalidRequest, match="share GPUs"):
        mii_server.serve(tensor_parallel=2, replica_num=2, device_map=[[0, 1], [1, 2]], deployment_name="overlap")
