"""Integration: bad input at every edge, abandoned REST requests, forged request ids, CORS, and a replica
killed under a non-streaming OpenAI request (2 replicas, REST gateway and OpenAI server, CPU, demo model).

Every malformed request gets a 4xx (HTTP) or INVALID_ARGUMENT (gRPC) whose body says what is wrong, and
the deployment keeps serving. The replica-kill test runs last: it leaves a replica restarting.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import requests

import mii_server
from mii_server.errors import InvalidRequest
from mii_server.serving.control import registry
from mii_server.serving.frontends.client import Client
from mii_server.wire import generation_pb2 as pb
from mii_server.wire import generation_pb2_grpc

from .helpers import free_port_block, sample, scrape, wait_for

pytestmark = pytest.mark.integration

NAME = "edges-itest"
MODEL = "mii-server-demo"
PROMPT = "The quick brown fox"
ORIGIN = "http://app.example"
BODY_LIMIT = 1 << 20  # max_request_body_bytes of this deployment
HUGE = 210 * 2**20  # what the adversarial test sent


@dataclass
class Deployment:
    client: Client
    base: int  # load balancer port; replicas base+1, base+2; their metrics base+3, base+4
    rest_port: int
    openai_port: int
    log_dir: Path

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}/mii/{NAME}"

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"

    def replica_metrics(self) -> list[str]:
        return [f"http://127.0.0.1:{self.base + 3 + i}/metrics" for i in range(2)]

    def idle(self) -> bool:
        return all(s.running == 0 and s.waiting == 0 and s.free_blocks == s.total_blocks for s in self.client.stats())

    def serves(self) -> None:
        """The deployment still answers, on every front end."""
        assert self.client.generate(PROMPT, max_new_tokens=2)[0].generated_length == 2
        assert requests.post(self.rest_url, json={"prompts": PROMPT, "max_new_tokens": 2}, timeout=30).status_code == 200
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        assert requests.post(self.openai_url + "/v1/completions", json=body, timeout=30).status_code == 200


@pytest.fixture(scope="module")
def deployment(registry_env: str) -> Iterator[Deployment]:
    base = free_port_block(5)
    http = free_port_block(2)
    assert not set(range(http, http + 2)) & set(range(base, base + 5))
    client = mii_server.serve(
        deployment_name=NAME,
        port_number=base,
        replica_num=2,
        enable_restful_api=True,
        restful_api_port=http,
        enable_openai_api=True,
        openai_api_port=http + 1,
        allowed_origins=[ORIGIN],
        max_request_body_bytes=BODY_LIMIT,
    )
    record = registry.read(NAME)
    assert record is not None
    yield Deployment(client, base, http, http + 1, Path(record.log_dir))
    client.terminate_server()


def _sum(urls: list[str], name: str, **labels: str) -> float:
    return sum(sample(scrape(u), name, **labels) for u in urls)


# ---- the new generation kwargs and response fields, over REST and the Python client ------------------


def test_rest_and_the_client_carry_logprobs_penalties_and_token_ids(deployment: Deployment) -> None:
    kwargs = {"max_new_tokens": 4, "do_sample": False, "logprobs": 2, "prompt_logprobs": 1,
              "presence_penalty": 0.5, "repetition_penalty": 1.1, "logit_bias": {"65": 1.0}}  # fmt: skip
    (want,) = deployment.client.generate(PROMPT, **kwargs)
    assert len(want.logprobs) == 4 and all(len(e.top_logprobs) == 2 for e in want.logprobs)
    assert want.prompt_logprobs[0] is None and len(want.prompt_logprobs) == want.prompt_length
    ids = deployment.client.tokenize(PROMPT)[0].token_ids
    (by_ids,) = deployment.client.generate([ids], **kwargs)
    assert by_ids.token_ids == want.token_ids and by_ids.prompt_logprobs == want.prompt_logprobs
    streamed = list(deployment.client.generate_stream(PROMPT, **kwargs))
    assert [e.token_id for c in streamed for e in c.logprobs] == want.token_ids
    (rest,) = requests.post(deployment.rest_url, json={"prompts": [ids], **kwargs}, timeout=30).json()
    assert rest["token_ids"] == want.token_ids and rest["cached_tokens"] == want.cached_tokens
    assert [e["logprob"] for e in rest["logprobs"]] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert rest["prompt_logprobs"][0] is None and len(rest["prompt_logprobs"]) == want.prompt_length


# ---- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 2**63),
        ("top_k", 2**63),
        ("stop_token_ids", [2**64]),
        ("max_new_tokens", "1" + "0" * 5000),  # more digits than Python parses by default
    ],
)
def test_rest_huge_integers_are_400(deployment: Deployment, field: str, value: object) -> None:
    reply = requests.post(deployment.rest_url, data=f'{{"prompts": "a", "{field}": {value}}}', timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] in ("invalid_value", "invalid_json") and (field in error["message"] or "JSON" in error["message"])


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 2**63), ("top_k", 2**63), ("stop_token_ids", [2**63]), ("seed", 2**64)],
)
def test_openai_huge_integers_are_400(deployment: Deployment, field: str, value: object) -> None:
    body = f'{{"model": "{MODEL}", "prompt": "a", "{field}": {json.dumps(value)}}}'
    reply = requests.post(deployment.openai_url + "/v1/completions", data=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field


def test_a_lone_surrogate_is_400_everywhere(deployment: Deployment) -> None:
    raw = '{"prompts": "bad \\ud800 text", "max_new_tokens": 2}'
    rest = requests.post(deployment.rest_url, data=raw, timeout=30)
    assert rest.status_code == 400 and "not valid Unicode" in rest.json()["error"]["message"]
    raw = f'{{"model": "{MODEL}", "prompt": "bad \\ud800 text", "max_tokens": 2}}'
    openai_reply = requests.post(deployment.openai_url + "/v1/completions", data=raw, timeout=30)
    assert openai_reply.status_code == 400 and "not valid Unicode" in openai_reply.json()["error"]["message"]
    raw = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "\\udfff"}}], "max_tokens": 2}}'
    chat = requests.post(deployment.openai_url + "/v1/chat/completions", data=raw, timeout=30)
    assert chat.status_code == 400 and "messages[0].content" in chat.json()["error"]["message"]
    with pytest.raises(InvalidRequest, match="prompt 0 is not valid Unicode"):
        deployment.client.generate("\ud800")
    with pytest.raises(InvalidRequest, match=r"stop\[0\]"):
        deployment.client.generate("ok", stop=["\udc80"])
    deployment.serves()


def test_deeply_nested_json_is_400(deployment: Deployment) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    for url, body in (
        (deployment.rest_url, f'{{"prompts": "a", "stop": {deep}}}'),
        (deployment.openai_url + "/v1/completions", f'{{"prompt": {deep}}}'),
    ):
        reply = requests.post(url, data=body, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json", reply.text
    deployment.serves()


def test_the_python_client_refuses_bad_prompts_before_sending(deployment: Deployment) -> None:
    for bad in (123, None, {"a": 1}, [1.5], [True, 2], [[2**63]], [[]]):
        with pytest.raises(InvalidRequest):
            deployment.client.generate(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        deployment.client.generate([[1, 10**9]])


def _raw_request(port: int, head: str) -> tuple[int, dict]:
    """Send only a request head that announces a body, and read the reply: a server that refuses the
    body must answer before reading any of it."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_a_210_mb_body_is_413_before_it_is_read(deployment: Deployment) -> None:
    for port, path in ((deployment.rest_port, f"/mii/{NAME}"), (deployment.openai_port, "/v1/completions")):
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {HUGE}\r\n\r\n"
        )
        status, body = _raw_request(port, head)
        assert status == 413 and body["error"]["code"] == "request_too_large", body
        assert str(BODY_LIMIT) in body["error"]["message"]
    # just under the limit is read and served
    near = json.dumps({"prompts": "x", "max_new_tokens": 1, "stop": ["y" * (BODY_LIMIT - 100)]})
    assert requests.post(deployment.rest_url, data=near, timeout=30).status_code == 200
    deployment.serves()


def _raw_generate(address: str, message: bytes) -> grpc.RpcError:
    """Send hand-built protobuf bytes as a Generate request (no client-side checks) and return the error."""
    channel = grpc.insecure_channel(address)
    try:
        call = channel.unary_unary("/mii_server.wire.Generation/Generate")  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as info:
            call(message, timeout=30)
        return info.value
    finally:
        channel.close()


def test_invalid_utf8_in_a_hand_built_protobuf_is_invalid_argument(deployment: Deployment) -> None:
    bad_prompt = pb.GenerateRequest(prompts=[pb.Prompt(text=b"ok \xff\xfe bytes")]).SerializeToString()
    bad_stop = pb.GenerateRequest(
        prompts=[pb.Prompt(text=b"fine")], params=pb.GenerationParams(stop=[b"\xc3"])
    ).SerializeToString()
    lb, replica = f"127.0.0.1:{deployment.base}", f"127.0.0.1:{deployment.base + 1}"
    for address in (lb, replica):
        err = _raw_generate(address, bad_prompt)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt 0 is not valid UTF-8" in err.details()
        err = _raw_generate(address, bad_stop)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop[0] is not valid UTF-8" in err.details()
    chat = pb.ChatTemplateRequest(messages=[pb.ChatMessage(role=b"user", content=b"\x80")])
    with pytest.raises(grpc.RpcError) as info:
        generation_pb2_grpc.GenerationStub(grpc.insecure_channel(lb)).ApplyChatTemplate(chat, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages[0].content" in info.value.details()
    deployment.serves()


def test_a_forged_request_id_writes_no_log_line(deployment: Deployment) -> None:
    forged = "rid\nrequest_id=forged-line accepted prompts=1\r\x1b[2J"
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{deployment.base}"))
    request = pb.GenerateRequest(prompts=[pb.Prompt(text=PROMPT.encode())], request_id=forged.encode())
    assert len(stub.Generate(request, timeout=60).completions) == 1
    deployment.client.generate(PROMPT, max_new_tokens=2, request_id="client\nrequest_id=forged-line")
    logs = sorted(deployment.log_dir.glob("*.log"))
    assert logs
    for log in logs:
        lines = log.read_text().splitlines()
        assert not [line for line in lines if "forged-line" in line or line.startswith("request_id=")], log


# ---- disconnects -----------------------------------------------------------------------------------


def test_a_killed_client_of_a_unary_rest_request_aborts_its_prompts(deployment: Deployment) -> None:
    """A killed curl on unary REST: its prompts are aborted and their KV blocks freed."""
    urls = deployment.replica_metrics()
    aborted = _sum(urls, "mii_server:request_success_total", finished_reason="abort")
    generated = _sum(urls, "mii_server:generation_tokens_total")
    idle = deployment.client.stats()
    body = json.dumps({"prompts": [PROMPT, "A model server"], "max_new_tokens": 2000, "ignore_eos": True})
    script = "import sys, requests; requests.post(sys.argv[1], data=sys.argv[2], timeout=120)"
    caller = subprocess.Popen([sys.executable, "-c", script, deployment.rest_url, body])
    try:
        def holds_kv() -> bool:
            return all(s.free_blocks < i.free_blocks for s, i in zip(deployment.client.stats(), idle, strict=True))

        wait_for(holds_kv, 60, "both prompts to hold KV blocks")
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    wait_for(deployment.idle, 60, "KV blocks to return after the client was killed")
    assert _sum(urls, "mii_server:request_success_total", finished_reason="abort") - aborted == 2
    assert _sum(urls, "mii_server:generation_tokens_total") - generated < 2 * 2000


# ---- CORS ------------------------------------------------------------------------------------------


def test_cors_is_opt_in_per_origin(deployment: Deployment) -> None:
    ask = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
    for url, body in (
        (deployment.openai_url + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}),
        (deployment.rest_url, {"prompts": PROMPT, "max_new_tokens": 1}),
    ):
        preflight = requests.options(url, headers=ask, timeout=10)
        assert preflight.status_code == 204, preflight.text
        assert preflight.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
        assert preflight.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        other = requests.options(url, headers={**ask, "Origin": "http://evil.example"}, timeout=10)
        assert other.status_code == 403 and "Access-Control-Allow-Origin" not in other.headers
        assert other.json()["error"]["code"] == "origin_not_allowed"
        reply = requests.post(url, json=body, headers={"Origin": ORIGIN}, timeout=30)
        assert reply.status_code == 200 and reply.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "X-Request-Id" in reply.headers["Access-Control-Expose-Headers"]
        stranger = requests.post(url, json=body, headers={"Origin": "http://evil.example"}, timeout=30)
        assert stranger.status_code == 200 and "Access-Control-Allow-Origin" not in stranger.headers


# ---- a replica dies under a non-streaming request (last: it leaves a replica restarting) ----------


def test_a_non_streaming_request_survives_its_replica_dying(deployment: Deployment) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    url = deployment.openai_url + "/v1/completions"
    want = requests.post(url, json=body, timeout=120).json()["choices"][0]["text"]
    before = {s.address: s.generated_tokens for s in deployment.client.stats()}
    result: dict[str, object] = {}

    def call() -> None:
        result["reply"] = requests.post(url, json=body, timeout=120)

    caller = threading.Thread(target=call)
    caller.start()

    def generating() -> object:
        for s in deployment.client.stats():
            if s.healthy and s.generated_tokens - before.get(s.address, 0) > 20:
                return s
        return None

    victim = wait_for(generating, 60, "a replica to be generating for the request")
    os.kill(victim.pid, signal.SIGKILL)
    caller.join(120)
    reply = result["reply"]
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["text"] == want and reply.json()["usage"]["completion_tokens"] == 1500
    wait_for(lambda: all(s.healthy for s in deployment.client.stats()), 120, "the killed replica to be back")
