"""Integration: a deployment under the failures and abuse a demanding user sends (CPU, demo model).

Two replicas with a short stall timeout and a small admission queue, so every scenario runs in
seconds: overload refused at once and counted per prompt; a huge prompt refused before it is
tokenised; a replica stopped with SIGSTOP under load: its requests failed over, health answering
meanwhile, the replica killed and restarted by the supervisor.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import requests

import mii_server
from mii_server.errors import CapacityExceeded, InvalidRequest
from mii_server.serving.control import registry
from mii_server.serving.frontends.client import Client

from .helpers import free_port_block, wait_for

pytestmark = pytest.mark.integration

NAME = "reliability-itest"
MODEL = "mii-server-demo"
QUEUE = 8  # max_queued_requests per replica
STALL_S = 3.0
GREEDY = {"max_new_tokens": 8, "do_sample": False}


@dataclass
class Deployment:
    client: Client
    openai_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"


@pytest.fixture(scope="module")
def deployment(registry_env: str) -> Iterator[Deployment]:
    base = free_port_block(5)
    http = free_port_block(1)
    client = mii_server.serve(
        deployment_name=NAME, replica_num=2, port_number=base, enable_openai_api=True, openai_api_port=http,
        max_queued_requests=QUEUE, replica_stall_timeout_s=STALL_S,
    )  # fmt: skip
    yield Deployment(client, http)
    client.terminate_server()


def _received(client: Client) -> int:
    return sum(s.prompts_received for s in client.stats())


def test_overload_is_refused_at_once_and_counted_per_prompt(deployment: Deployment) -> None:
    client = deployment.client
    before = _received(client)
    # 2 * QUEUE + 4 prompts are dealt 10 per replica: each replica would have 10 waiting, over 8
    with pytest.raises(CapacityExceeded, match="max_queued_requests=8"):
        client.generate([f"prompt {i}" for i in range(2 * QUEUE + 4)], **GREEDY)
    # OpenAI: n=128 samples of one prompt is 128 prompts: refused with 503 and Retry-After
    reply = requests.post(
        deployment.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "n": 128, "max_tokens": 4},
        timeout=60,
    )
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "1"
    assert reply.json()["error"]["code"] == "overloaded"
    assert _received(client) == before  # nothing of either request ran
    assert requests.get(deployment.base_url + "/health", timeout=10).status_code == 200
    # within the limit, the same request shape is served
    assert len(client.generate([f"prompt {i}" for i in range(2 * QUEUE)], **GREEDY)) == 2 * QUEUE


def test_a_huge_prompt_is_refused_before_tokenisation(deployment: Deployment) -> None:
    huge = "word " * 2_000_000  # 10 MB: could never fit the context
    with pytest.raises(InvalidRequest, match="characters"):
        deployment.client.generate([huge], **GREEDY)
    assert deployment.client.generate(["a short one"], **GREEDY)[0].generated_length == 8


def test_a_stopped_replica_is_failed_over_and_restarted(deployment: Deployment) -> None:
    client = deployment.client
    stuck = client.stats()[1]
    os.kill(stuck.pid, signal.SIGSTOP)
    try:
        results: list[int] = []
        errors: list[BaseException] = []

        def caller(i: int) -> None:
            try:
                results.extend(r.generated_length for r in client.generate([f"caller {i}"], **GREEDY))
            except BaseException as err:  # noqa: BLE001 - every failure is counted, none may happen
                errors.append(err)

        callers = [threading.Thread(target=caller, args=(i,)) for i in range(6)]
        for thread in callers:  # half of them are dealt to the stopped replica first
            thread.start()
        health_took = []
        for _ in range(3):  # health answers from the serving replica meanwhile, quickly
            started = time.monotonic()
            assert requests.get(deployment.base_url + "/health", timeout=10).status_code == 200
            health_took.append(time.monotonic() - started)
            time.sleep(0.5)
        for thread in callers:
            thread.join(timeout=120)
        assert errors == [] and results == [8] * 6
        assert max(health_took) < STALL_S  # never waits on the silent replica

        def restarted() -> bool:
            now = client.stats()[1]
            return now.healthy and now.pid not in (0, stuck.pid)

        wait_for(restarted, 180, "the supervisor to kill the stopped replica and start a new one", interval=0.5)
    finally:
        if registry.pid_alive(stuck.pid):
            os.kill(stuck.pid, signal.SIGCONT)  # the test failed before the watchdog acted: let it go
    before = client.stats()[1].prompts_received
    client.generate([f"again {i}" for i in range(4)], **GREEDY)
    assert client.stats()[1].prompts_received > before  # the new process serves
