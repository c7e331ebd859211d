"""Integration: one real deployment (2 replicas + load balancer + REST gateway + OpenAI server, each of
the two in 2 processes on its port) on loopback, CPU, demo model.

Tests run in file order and share the deployment; the last one terminates it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

import mii_server
from mii_server.errors import InvalidRequest, ReplicaUnavailable
from mii_server.generation.response import FinishReason, Response
from mii_server.serving.control import registry
from mii_server.serving.control.ports import port_is_free
from mii_server.serving.frontends.client import Client

from .helpers import (
    deployment_processes,
    descendants,
    free_port_block,
    listening_addresses,
    sample,
    scrape,
    wait_for,
)

pytestmark = pytest.mark.integration

NAME = "itest-deployment"
GREEDY = {"max_new_tokens": 8, "do_sample": False}
PROMPTS = [f"Request {i}: the quick brown fox{' jumps' * (i % 5)}" for i in range(64)]


@dataclass
class Deployment:
    client: Client
    lb_port: int
    rest_port: int
    openai_port: int

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}/mii/{NAME}"

    def port(self, role: str) -> int:
        """The port of an HTTP front end's processes (``rest-gateway`` or ``openai-server``)."""
        return self.rest_port if role == "rest-gateway" else self.openai_port


@pytest.fixture(scope="module")
def expected() -> list[Response]:
    pipe = mii_server.pipeline("")
    try:
        return pipe(PROMPTS, **GREEDY)
    finally:
        pipe.destroy()


@pytest.fixture(scope="module")
def deployment(registry_env: str) -> Deployment:
    base = free_port_block(3)
    rest = free_port_block(2)
    assert not {rest, rest + 1} & set(range(base, base + 3))
    client = mii_server.serve(
        deployment_name=NAME, replica_num=2, enable_restful_api=True, port_number=base, restful_api_port=rest,
        restful_api_workers=2, enable_openai_api=True, openai_api_port=rest + 1, openai_api_workers=2,
    )  # fmt: skip
    yield Deployment(client, base, rest, rest + 1)
    record = registry.read(NAME)
    if record is not None and record.is_alive():  # a test failed before the terminate test
        client.terminate_server()


def _same(got: Response, want: Response) -> None:
    assert (
        got.generated_text,
        got.token_ids,
        got.finish_reason,
        got.prompt_length,
        got.generated_length,
    ) == (
        want.generated_text,
        want.token_ids,
        want.finish_reason,
        want.prompt_length,
        want.generated_length,
    )


def test_64_prompts_from_4_threads_equal_pipeline_and_use_both_replicas(deployment, expected) -> None:
    before = {s.replica_index: s.prompts_received for s in deployment.client.stats()}
    results: dict[int, list[Response]] = {}
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            results[t] = deployment.client.generate(PROMPTS[t::4], **GREEDY)
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the test thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for t in range(4):
        for got, want in zip(results[t], expected[t::4], strict=True):
            _same(got, want)
    after = {s.replica_index: s for s in deployment.client.stats()}
    served = {i: after[i].prompts_received - before[i] for i in after}
    assert sum(served.values()) == 64
    assert served[0] > 0 and served[1] > 0, served
    # a finished sequence's blocks are freed at the engine's next step, just after its reply
    wait_for(
        lambda: all(
            s.healthy and s.running == 0 and s.free_blocks == s.total_blocks for s in deployment.client.stats()
        ),
        30,
        "both replicas to be idle with every KV block free",
    )


def test_streaming_several_prompts_through_the_load_balancer(deployment, expected) -> None:
    chosen = [0, 7, 12, 33, 50]
    texts: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    finals: dict[int, FinishReason] = {}
    counts: dict[int, int] = {}
    for chunk in deployment.client.generate_stream([PROMPTS[i] for i in chosen], **GREEDY):
        i = chunk.prompt_index
        assert i not in finals, "chunk after the final one"
        texts[i] = texts.get(i, "") + chunk.generated_text
        tokens[i] = tokens.get(i, []) + chunk.token_ids
        counts[i] = counts.get(i, 0) + 1
        if chunk.finish_reason is not FinishReason.NONE:
            finals[i] = chunk.finish_reason
    for k, i in enumerate(chosen):
        assert texts[k] == expected[i].generated_text and tokens[k] == expected[i].token_ids
        assert finals[k] == expected[i].finish_reason
        assert counts[k] > 1  # token by token, not one blob


def test_mii_streaming_fn_callback(deployment, expected) -> None:
    chosen = [3, 9]
    seen: list[list[Response]] = []
    out = deployment.client.generate([PROMPTS[i] for i in chosen], streaming_fn=seen.append, **GREEDY)
    for k, i in enumerate(chosen):
        _same(out[k], expected[i])
        mine = [batch[0] for batch in seen if batch[0].prompt_index == k]
        assert "".join(c.generated_text for c in mine) == expected[i].generated_text
    assert all(len(batch) == 1 for batch in seen) and len(seen) > len(chosen)  # chunk by chunk


def test_async_twins(deployment, expected) -> None:
    async def main() -> tuple[list[Response], dict[int, str]]:
        plain = await deployment.client.agenerate(PROMPTS[:3], **GREEDY)
        streamed: dict[int, str] = {}
        async for chunk in deployment.client.agenerate_stream(PROMPTS[:3], **GREEDY):
            streamed[chunk.prompt_index] = streamed.get(chunk.prompt_index, "") + chunk.generated_text
        return plain, streamed

    plain, streamed = asyncio.run(main())
    for got, want in zip(plain, expected[:3], strict=True):
        _same(got, want)
    assert streamed == {i: expected[i].generated_text for i in range(3)}


def test_server_side_errors_arrive_typed_with_the_servers_message(deployment) -> None:
    with pytest.raises(InvalidRequest, match="prompt has .* tokens"):
        deployment.client.generate(["word " * 3000], max_new_tokens=4)
    # the deployment still serves afterwards
    assert deployment.client.generate(PROMPTS[:1], **GREEDY)[0].generated_length == 8


def test_a_second_process_reconnects_by_name(deployment, expected) -> None:
    code = (
        "import json, mii_server; "
        f"c = mii_server.client({NAME!r}); "
        f"print(json.dumps([r.generated_text for r in c.generate({PROMPTS[:3]!r}, **{GREEDY!r})]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [r.generated_text for r in expected[:3]]


def _curl(*args: str) -> tuple[int, str]:
    out = subprocess.run(
        ["curl", "-sS", "-N", "-w", "\n%{http_code}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    body, _, status = out.stdout.rpartition("\n")
    return int(status), body


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl binary")
def test_curl_plain_and_streaming(deployment, expected) -> None:
    body = json.dumps({"prompts": PROMPTS[:3], **GREEDY})
    status, text = _curl(
        "-X", "POST", "-H", "Content-Type: application/json", "-d", body, deployment.rest_url
    )
    assert status == 200
    plain = json.loads(text)
    assert [r["generated_text"] for r in plain] == [r.generated_text for r in expected[:3]]
    assert plain[0]["finish_reason"] == expected[0].finish_reason.value

    body = json.dumps({"prompts": PROMPTS[:3], "stream": True, **GREEDY})
    status, text = _curl("-X", "POST", "-d", body, deployment.rest_url)
    assert status == 200
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    joined: dict[int, str] = {}
    for event in events[:-1]:
        assert event.startswith("data: ")
        chunk = json.loads(event.removeprefix("data: "))
        joined[chunk["prompt_index"]] = joined.get(chunk["prompt_index"], "") + chunk["generated_text"]
    assert [joined[i] for i in range(3)] == [r["generated_text"] for r in plain]


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl binary")
@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ('{"prompts": ["a"], "max_new_tokens": 4', "not valid JSON"),
        ('{"prompts": ["a"], "max_new_tokns": 4}', "max_new_tokns"),
        ('{"prompts": ["a"], "max_new_tokens": "four"}', "max_new_tokens"),
        ('{"prompts": 5}', "prompts"),
    ],
)
def test_curl_bad_requests_get_400_json(deployment, body: str, fragment: str) -> None:
    status, text = _curl("-X", "POST", "-d", body, deployment.rest_url)
    assert status == 400
    assert fragment in json.loads(text)["error"]["message"]


# each HTTP front end's generation route, as its access log names it
GENERATION_ROUTE = {"rest-gateway": "/mii/<name>", "openai-server": "/v1/completions"}


def _generate_on_a_new_connection(deployment: Deployment, role: str, i: int) -> str:
    """PROMPTS[i]'s greedy text from the front end ``role``, on a connection of its own."""
    if role == "rest-gateway":
        url, body = deployment.rest_url, {"prompts": [PROMPTS[i]], **GREEDY}
    else:
        url = f"http://127.0.0.1:{deployment.openai_port}/v1/completions"
        body = {"model": "mii-server-demo", "prompt": PROMPTS[i], "max_tokens": GREEDY["max_new_tokens"], "temperature": 0}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:  # urllib closes the connection after each
        answer = json.loads(reply.read())
    return answer[0]["generated_text"] if role == "rest-gateway" else answer["choices"][0]["text"]


def _served(log_dir: Path, role: str) -> list[int]:
    """Generation requests each of the two processes of front end ``role`` has logged so far."""
    logs = [log_dir / f"{role}-{k}.log" for k in range(2)]
    line = f"path={GENERATION_ROUTE[role]} status=200"
    return [sum(line in text for text in log.read_text().splitlines()) for log in logs]


def _answers_healthz(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as reply:
            return reply.status == 200
    except OSError:  # reset (urllib raises it bare, or as a URLError)
        return False


def _exited(pid: int) -> bool:
    """Every thread of it has exited (the leader alone can be a zombie while its ~1,000 waitress threads
    are still exiting, holding its sockets), or it is gone."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return True
    for task in tasks:
        try:
            if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX":
                return False
        except OSError:  # this thread is gone
            continue
    return True


FRONT_ENDS = ["rest-gateway", "openai-server"]


@pytest.mark.parametrize("role", FRONT_ENDS)
def test_two_processes_of_a_front_end_share_its_port_and_answer_metrics_for_both(deployment, expected, role) -> None:
    metrics_url = f"http://127.0.0.1:{deployment.port(role)}/metrics"
    route = GENERATION_ROUTE[role]
    counted_before = sample(scrape(metrics_url), "mii_server:http_requests_total", route=route)
    log_dir = Path(registry.read(NAME).log_dir)
    served_before = _served(log_dir, role)
    for i in range(16):  # the kernel deals connections, not requests: each on its own
        assert _generate_on_a_new_connection(deployment, role, i) == expected[i].generated_text
    # A front end logs and counts a request once its last byte is out, which can be just after the
    # caller has read it: wait (bounded) for the 16th line rather than race it.
    def served_since() -> list[int]:
        return [now - then for now, then in zip(_served(log_dir, role), served_before, strict=True)]

    wait_for(lambda: sum(served_since()) >= 16, 10, "every request's access log line")
    served = served_since()
    assert sum(served) == 16 and min(served) > 0, served  # both took some (all to one: 2 * 2**-16 odds)
    counted = sample(scrape(metrics_url), "mii_server:http_requests_total", route=route)
    assert counted - counted_before == 16  # whichever process the scrape reached counts both


@pytest.mark.parametrize("role", FRONT_ENDS)
def test_a_sigkilled_front_end_process_is_restarted_while_the_other_serves(deployment, expected, registry_env, role) -> None:
    port = deployment.port(role)
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    route = GENERATION_ROUTE[role]
    counted_before = sample(scrape(metrics_url), "mii_server:http_requests_total", route=route)
    old = deployment_processes(NAME, registry_env, role=role)
    assert len(old) == 2
    os.kill(old[0], signal.SIGKILL)
    # A connection dealt to it as it dies is reset (what that caller sees); once its listening socket
    # is closed, new connections go to the other process.
    wait_for(lambda: _exited(old[0]) and _answers_healthz(port), 30, "the other process to take the port")
    for i in range(4):
        assert _generate_on_a_new_connection(deployment, role, i) == expected[i].generated_text

    def restarted_and_listening() -> bool:
        now = deployment_processes(NAME, registry_env, role=role)
        ports = {p for _, p in listening_addresses([pid for pid in now if pid not in old])}
        return len(now) == 2 and old[0] not in now and port in ports

    wait_for(restarted_and_listening, 60, f"the killed {role} process to come back on the port")
    for i in range(4, 12):
        assert _generate_on_a_new_connection(deployment, role, i) == expected[i].generated_text

    def counted_since() -> float:  # counted once a request's last byte is out: maybe after it was read
        return sample(scrape(metrics_url), "mii_server:http_requests_total", route=route) - counted_before

    wait_for(lambda: counted_since() >= 12, 10, "every request's count")
    assert counted_since() == 12  # the killed process's counts stay in the sum


def test_leaving_a_stream_aborts_the_request_and_frees_its_kv_blocks(deployment) -> None:
    before = sum(s.generated_tokens for s in deployment.client.stats())
    stream = deployment.client.generate_stream(["Tell me a long story"], max_new_tokens=1500, ignore_eos=True)
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    stream.close()  # cancels the RPC: load balancer -> replica -> engine abort

    def idle() -> bool:
        stats = deployment.client.stats()
        return all(s.running == 0 and s.waiting == 0 and s.free_blocks == s.total_blocks for s in stats)

    wait_for(idle, 60, "every KV block to be free again")
    generated = sum(s.generated_tokens for s in deployment.client.stats()) - before
    assert 3 <= generated < 1500  # stopped early: aborted, not finished


def test_a_sigkilled_replica_is_restarted_and_serves_again(deployment, expected) -> None:
    old = deployment.client.stats()[1]
    os.kill(old.pid, signal.SIGKILL)
    # requests keep working meanwhile (the load balancer routes around the dead replica)
    for got, want in zip(deployment.client.generate(PROMPTS[:4], **GREEDY), expected[:4], strict=True):
        _same(got, want)

    def restarted() -> bool:
        now = deployment.client.stats()[1]
        return now.healthy and now.pid not in (0, old.pid)

    wait_for(restarted, 180, "replica 1 to come back with a new pid")
    for got, want in zip(deployment.client.generate(PROMPTS[:6], **GREEDY), expected[:6], strict=True):
        _same(got, want)
    assert deployment.client.stats()[1].prompts_received > 0  # the new process served some of them


def test_a_stream_with_output_ends_at_once_when_its_load_balancer_dies(deployment, expected, registry_env) -> None:
    """Output already streamed is never repeated: a stream whose load balancer is killed after its first
    chunk ends with ``ReplicaUnavailable`` without waiting, the replica drops its copy, and the next
    call waits for the restarted balancer."""
    (old,) = deployment_processes(NAME, registry_env, role="load-balancer")
    stream = deployment.client.generate_stream(["Tell me a long story"], max_new_tokens=1500, ignore_eos=True)
    assert next(stream).generated_length > 0
    os.kill(old, signal.SIGKILL)
    with pytest.raises(ReplicaUnavailable) as info:
        for _chunk in stream:
            pass
    assert "waited" not in str(info.value)
    _same(deployment.client.generate([PROMPTS[5]], **GREEDY)[0], expected[5])

    def idle() -> bool:
        return all(s.running == 0 and s.free_blocks == s.total_blocks for s in deployment.client.stats())

    wait_for(idle, 30, "the replicas to drop the lost stream and free its KV blocks")


def test_calls_made_while_a_sigkilled_load_balancer_is_down_wait_for_its_restart(
    deployment, expected, registry_env
) -> None:
    """Every way in (the Python client unary, streaming and async; REST; OpenAI) holds a call made while
    the load balancer is gone, and sends it once the supervisor's new one answers. The supervisor is
    held (SIGSTOP) so the calls are made while nothing listens on the balancer's port."""
    supervisor = registry.read(NAME).supervisor_pid
    (old,) = deployment_processes(NAME, registry_env, role="load-balancer")
    os.kill(supervisor, signal.SIGSTOP)
    try:
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: _exited(old), 10, "the load balancer to exit")
        assert port_is_free("127.0.0.1", deployment.lb_port)
        client = deployment.client
        texts: dict[str, str] = {}
        errors: list[BaseException] = []

        def asynchronous() -> str:
            return asyncio.run(client.agenerate([PROMPTS[2]], **GREEDY))[0].generated_text

        calls = {
            "unary": lambda: client.generate([PROMPTS[0]], **GREEDY)[0].generated_text,
            "stream": lambda: "".join(c.generated_text for c in client.generate_stream([PROMPTS[1]], **GREEDY)),
            "async": asynchronous,
            "rest-gateway": lambda: _generate_on_a_new_connection(deployment, "rest-gateway", 3),
            "openai-server": lambda: _generate_on_a_new_connection(deployment, "openai-server", 4),
        }

        def call(name: str) -> None:
            try:
                texts[name] = calls[name]()
            except BaseException as err:  # noqa: BLE001 - re-raised below, in the test thread
                errors.append(err)

        threads = [threading.Thread(target=call, args=(name,)) for name in calls]
        for thread in threads:
            thread.start()
        time.sleep(1.0)  # why a fixed pause: the calls must be seen waiting a while, not failed
        assert errors == [] and texts == {}  # waiting, not failed
    finally:
        os.kill(supervisor, signal.SIGCONT)
    for thread in threads:
        thread.join(timeout=60)
    assert errors == [], errors
    assert texts == {name: expected[i].generated_text for i, name in enumerate(calls)}
    assert deployment_processes(NAME, registry_env, role="load-balancer") != [old]


def test_terminate_leaves_no_process_and_frees_every_port(deployment, registry_env) -> None:
    supervisor = registry.read(NAME).supervisor_pid
    tree = descendants(supervisor) | {supervisor}
    assert len(tree) >= 8  # supervisor, 2 replicas, load balancer, 2 REST gateway and 2 OpenAI processes
    deployment.client.terminate_server()
    alive = [pid for pid in tree if registry.pid_alive(pid)]
    assert alive == []
    assert deployment_processes(NAME, registry_env) == []
    assert registry.read(NAME) is None
    for port in (*range(deployment.lb_port, deployment.lb_port + 3), deployment.rest_port, deployment.openai_port):
        assert port_is_free("127.0.0.1", port), port
