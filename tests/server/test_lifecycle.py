"""Integration: start-up failures are clear and immediate; the CLI serves in the foreground."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mii_server
from mii_server.errors import DeploymentStartError, UnknownArgument
from mii_server.serving.control import registry

from .helpers import deployment_processes, descendants, free_port_block, wait_for

pytestmark = pytest.mark.integration


def test_unknown_kwargs_raise_before_anything_starts(registry_env: str) -> None:
    with pytest.raises(UnknownArgument, match="replicas"):
        mii_server.serve(replicas=2, port_number=free_port_block(2))
    assert registry.list_records() == []
    assert not (Path(registry_env) / "logs").exists()


def test_a_port_in_use_is_a_clear_error(registry_env: str) -> None:
    port = free_port_block(2)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port + 1))
        holder.listen(1)
        started = time.monotonic()
        with pytest.raises(DeploymentStartError, match=rf"127\.0\.0\.1:{port + 1} \(replica 0\)"):
            mii_server.serve(port_number=port)
        assert time.monotonic() - started < 10  # an error, not a hang
    assert registry.list_records() == []


def test_a_child_dying_during_start_up_raises_with_its_log_tail(registry_env: str, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(DeploymentStartError) as info:
        mii_server.serve(str(missing), port_number=free_port_block(2), deployment_name="broken")
    message = str(info.value)
    assert "replica 0" in message and "exited with status" in message
    assert "no-such-model" in message  # from the replica's own traceback, via its log
    assert registry.read("broken") is None
    assert deployment_processes("broken", registry_env) == []


def test_cli_serves_in_the_foreground_and_ctrl_c_tears_down(registry_env: str) -> None:
    port = free_port_block(2)
    name = "cli-deployment"
    cli = [sys.executable, "-m", "mii_server.cli"]
    proc = subprocess.Popen(
        [*cli, "serve", "--port", str(port), "--deployment-name", name],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(
            lambda: (r := registry.read(name)) is not None and r.state == "ready" or proc.poll() is not None,
            180,
            "the CLI deployment to be ready",
        )
        assert proc.poll() is None, proc.stdout.read()
        out = subprocess.run(
            [*cli, "generate", "-d", name, "--greedy", "--max-new-tokens", "8", "--json", "Hello", "World"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        replies = [json.loads(line) for line in out.splitlines()]
        assert [r["generated_length"] for r in replies] == [8, 8]
        status = subprocess.run(
            [*cli, "status"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
        assert f"{name}: ready" in status
        tree = descendants(proc.pid)
        assert len(tree) >= 2  # replica and load balancer
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert proc.wait(timeout=60) == 0
        assert [pid for pid in tree if registry.pid_alive(pid)] == []
        assert deployment_processes(name, registry_env) == []
        assert registry.read(name) is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
