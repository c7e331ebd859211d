"""`mii-server replica --tensor-parallel 2` on its own (as a pod runs it): rank 0 starts rank 1, which
logs to the replica's own stderr; the text is one rank's; SIGTERM stops both ranks, exit 0."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from server.helpers import descendants, free_port_block, wait_for

import mii_server
from mii_server.serving import grpc_common
from mii_server.serving.frontends.client import Client

pytestmark = pytest.mark.integration

PROMPTS = ["the quick brown fox", "a model server"]
GREEDY = {"max_new_tokens": 8, "do_sample": False, "ignore_eos": True}


def test_a_tensor_parallel_replica_on_its_own(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    path = str(tiny_checkpoints["llama"])
    pipe = mii_server.pipeline(path)
    expected = [r.token_ids for r in pipe(PROMPTS, **GREEDY)]
    pipe.destroy()
    port, metrics = free_port_block(2), free_port_block(1)
    log = tmp_path / "replica.log"
    args = ["replica", path, "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mii_server.cli", *args, "--tensor-parallel", "2", "--device", "cpu"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        channel = grpc_common.channel(f"127.0.0.1:{port}")
        wait_for(
            lambda: proc.poll() is None and grpc_common.is_serving(channel, 1.0, grpc_common.SERVICE_NAME),
            180,
            "the replica to load on two ranks",
        )
        channel.close()
        assert proc.poll() is None, log.read_text()
        ranks = descendants(proc.pid)
        assert len(ranks) == 1  # rank 1
        with Client(f"127.0.0.1:{port}") as client:
            assert [r.token_ids for r in client.generate(PROMPTS, **GREEDY)] == expected
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        wait_for(lambda: not _alive(ranks), 30, "rank 1 to exit")
        assert "replica-rank[" in log.read_text()  # rank 1 wrote to the replica's stderr: one log stream per pod
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists() and "zombie" not in _state(p)}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split("\n", 1)[0].lower()
    except (OSError, IndexError):
        return "zombie"
