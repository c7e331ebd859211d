"""Integration: the OpenAI-compatible server of a real deployment (1 replica, CPU, demo model), driven by the
official ``openai`` package and raw HTTP; its metrics, health, request ids and disconnect handling.

One deployment for the module; every test leaves it idle (nothing running, every KV block free).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

import mii_server
from mii_server.serving.control import registry
from mii_server.serving.frontends.client import Client

from .helpers import free_port_block, wait_for

pytestmark = pytest.mark.integration

NAME = "openai-itest"
MODEL = "mii-server-demo"
KEY = "test-key-0123456789"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}]


@dataclass
class Deployment:
    client: Client
    openai_port: int
    metrics_port: int
    log_dir: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"

    def openai(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=key, max_retries=0)

    def idle(self) -> bool:
        (s,) = self.client.stats()
        return s.running == 0 and s.waiting == 0 and s.free_blocks == s.total_blocks


@pytest.fixture(scope="module")
def deployment(registry_env: str) -> Iterator[Deployment]:
    base = free_port_block(3)  # load balancer, replica, replica metrics
    http = free_port_block(1)
    assert http not in range(base, base + 3)
    old = os.environ.get("MII_SERVER_API_KEY")
    os.environ["MII_SERVER_API_KEY"] = KEY  # children inherit it; keys never travel in argv
    try:
        client = mii_server.serve(
            deployment_name=NAME, port_number=base, enable_openai_api=True, openai_api_port=http
        )
    finally:
        if old is None:
            os.environ.pop("MII_SERVER_API_KEY")
        else:
            os.environ["MII_SERVER_API_KEY"] = old
    record = registry.read(NAME)
    assert record is not None and record.openai_url == f"http://127.0.0.1:{http}/v1"
    yield Deployment(client, http, base + 2, Path(record.log_dir))
    client.terminate_server()


@pytest.fixture(scope="module")
def pipe() -> Iterator[object]:
    p = mii_server.pipeline("")
    yield p
    p.destroy()


@pytest.fixture(autouse=True)
def _ends_idle(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "deployment" in request.fixturenames:
        dep = request.getfixturevalue("deployment")
        wait_for(dep.idle, 60, "the replica to be idle after the test")


def _metrics(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple], float]:
    text = requests.get(url, headers=headers, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _sample(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


# ---- models, auth, errors -------------------------------------------------------------------------


def test_models_and_authentication(deployment: Deployment) -> None:
    assert [m.id for m in deployment.openai().models.list()] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        deployment.openai("wrong-key").models.list()
    with pytest.raises(openai.AuthenticationError):
        deployment.openai("wrong-key").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    missing = requests.post(deployment.base_url + "/v1/completions", json={"prompt": PROMPT}, timeout=10)
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(deployment.base_url + "/metrics", timeout=10).status_code == 401
    # health needs no key, and reflects the replicas
    health = requests.get(deployment.base_url + "/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["replicas"] == [{"index": 0, "healthy": True}]
    replica_health = requests.get(f"http://127.0.0.1:{deployment.metrics_port}/health", timeout=10)
    assert replica_health.status_code == 200 and replica_health.json()["state"] == "serving"


def test_errors_have_openai_shape(deployment: Deployment) -> None:
    api = deployment.openai()
    with pytest.raises(openai.NotFoundError) as err:
        api.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert err.value.param == "model" and err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=3)
    assert err.value.param == "temperature"
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logprobs=1)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logprobs=True)
    with pytest.raises(openai.BadRequestError, match="stream"):
        api.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, stream_options={"include_usage": True}
        )
    too_long = "fox " * 3000  # more tokens than the demo model's 2048-token context
    with pytest.raises(openai.BadRequestError, match="max_length"):
        api.completions.create(model=MODEL, prompt=too_long, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_length"):  # before any byte of the stream
        api.completions.create(model=MODEL, prompt=too_long, max_tokens=2, stream=True)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048"):  # prompt fits, output not
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4000)
    bad_json = requests.post(
        deployment.base_url + "/v1/chat/completions",
        data=b"{not json",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=10,
    )
    assert bad_json.status_code == 400 and set(bad_json.json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }


# ---- completions ----------------------------------------------------------------------------------


def test_greedy_completion_equals_pipeline(deployment: Deployment, pipe: object) -> None:
    (want,) = pipe([PROMPT], max_new_tokens=12, do_sample=False)
    got = deployment.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"unknown_field": 1}
    )
    assert got.choices[0].text == want.generated_text
    assert got.choices[0].finish_reason == want.finish_reason.value
    assert got.usage.prompt_tokens == want.prompt_length
    assert got.usage.completion_tokens == want.generated_length
    assert got.usage.total_tokens == want.prompt_length + want.generated_length


def test_completion_stream_echo_and_prompt_list(deployment: Deployment) -> None:
    api = deployment.openai()
    prompts = [PROMPT, "A model server"]
    whole = api.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in whole.choices] == [0, 1]
    texts = ["", ""]
    usage = None
    for chunk in api.completions.create(
        model=MODEL,
        prompt=prompts,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in whole.choices]
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()
    echoed = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + whole.choices[0].text


def test_n_with_seed_gives_distinct_reproducible_samples(deployment: Deployment) -> None:
    api = deployment.openai()
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0}
    kwargs["extra_body"] = {"ignore_eos": True}
    two = api.completions.create(n=2, seed=7, **kwargs)
    assert [c.index for c in two.choices] == [0, 1]
    texts = [c.text for c in two.choices]
    assert texts[0] != texts[1]
    # choice j is sample j: the same as a single request seeded seed + j
    singles = [api.completions.create(n=1, seed=7 + j, **kwargs).choices[0].text for j in range(2)]
    assert singles == texts
    assert (
        two.usage.completion_tokens == 20
        and two.usage.prompt_tokens == api.completions.create(n=1, seed=1, **kwargs).usage.prompt_tokens
    )


def test_stop_list(deployment: Deployment) -> None:
    api = deployment.openai()
    full = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    clean = [i for i in range(2, len(full) - 2) if "\ufffd" not in full[i : i + 2]]
    assert clean, f"no usable stop string in {full!r}"
    stop = full[clean[0] : clean[0] + 2]
    got = api.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=["never-appears", stop]
    ).choices[0]
    assert got.text == full[: full.index(stop)]
    assert got.finish_reason == "stop"


# ---- chat -----------------------------------------------------------------------------------------


def test_chat_plain_and_stream(deployment: Deployment, pipe: object) -> None:
    rendered = deployment.client.apply_chat_template([(m["role"], m["content"]) for m in MESSAGES])
    assert rendered == "<|system|>\nBe brief.\n<|user|>\nName a fox.\n<|assistant|>\n"  # demo CHAT_TEMPLATE
    (want,) = pipe([rendered], max_new_tokens=10, do_sample=False)
    api = deployment.openai()
    got = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.generated_text
    assert got.choices[0].finish_reason == want.finish_reason.value
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
        want.prompt_length,
        want.generated_length,
    )

    chunks = list(
        api.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == want.generated_text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == want.finish_reason.value and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage.completion_tokens == want.generated_length


def test_chat_n2(deployment: Deployment) -> None:
    got = deployment.openai().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, n=2, seed=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in got.choices] == [0, 1]
    assert got.choices[0].message.content != got.choices[1].message.content
    assert got.usage.completion_tokens == 12


# ---- request ids, metrics, disconnects ------------------------------------------------------------


def test_request_id_is_echoed_and_reaches_the_replica_log(deployment: Deployment) -> None:
    reply = requests.post(
        deployment.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "rid-test-42"},
        timeout=30,
    )
    assert reply.status_code == 200 and reply.headers["X-Request-Id"] == "rid-test-42"
    assert reply.json()["id"] == "cmpl-rid-test-42"
    log = deployment.log_dir / "replica-0.log"
    wait_for(
        lambda: "request_id=rid-test-42 uid=" in log.read_text(), 10, "the request id in the replica log"
    )
    fresh = requests.get(
        deployment.base_url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10
    )
    assert len(fresh.headers["X-Request-Id"]) == 32  # generated when the caller sends none


def test_metrics_count_requests_and_tokens(deployment: Deployment) -> None:
    replica_url = f"http://127.0.0.1:{deployment.metrics_port}/metrics"
    gateway_url = deployment.base_url + "/metrics"
    auth = {"Authorization": f"Bearer {KEY}"}
    before, gw_before = _metrics(replica_url), _metrics(gateway_url, auth)
    api = deployment.openai()
    prompt_tokens = 0
    for i in range(3):
        reply = api.completions.create(
            model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.usage.completion_tokens == 5
        prompt_tokens += reply.usage.prompt_tokens
    after, gw_after = _metrics(replica_url), _metrics(gateway_url, auth)

    def delta(name: str, m0: dict = before, m1: dict = after, **labels: str) -> float:
        return _sample(m1, name, **labels) - _sample(m0, name, **labels)

    assert delta("mii_server:generation_tokens_total", replica="0") == 15
    assert delta("mii_server:prompt_tokens_total", replica="0") == prompt_tokens
    assert delta("mii_server:request_success_total", replica="0", finished_reason="length") == 3
    for hist in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    ):
        assert delta(f"mii_server:{hist}_count", replica="0") == 3
    assert delta("mii_server:request_generation_tokens_sum", replica="0") == 15
    assert _sample(after, "mii_server:num_requests_running", replica="0") == 0
    total = _sample(after, "mii_server:kv_cache_blocks_total", replica="0")
    assert total > 0 and _sample(after, "mii_server:kv_cache_blocks_used", replica="0") == 0
    # the gateway counts its HTTP requests and reports the replicas' counters through the load balancer
    ok = {"route": "/v1/completions", "status": "200"}
    assert delta("mii_server:http_requests_total", gw_before, gw_after, **ok) == 3
    assert delta("mii_server:generation_tokens_total", gw_before, gw_after, replica="0") == 15


def test_client_disconnect_mid_stream_frees_kv_blocks(deployment: Deployment) -> None:
    replica_url = f"http://127.0.0.1:{deployment.metrics_port}/metrics"
    before = _metrics(replica_url)
    (idle,) = deployment.client.stats()
    # as long as the demo model's context allows, so the stream is still running when the client leaves
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    reply = requests.post(
        deployment.base_url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        stream=True,
        timeout=60,
    )
    try:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        while not next(lines).startswith(b"data: "):
            pass
        # why before leaving the loop: dropping the line iterator closes the connection at once
        (busy,) = deployment.client.stats()
        # why not running == 1: the engine's running count is read without a lock and can flicker to 0 mid-step
        assert busy.free_blocks < idle.free_blocks  # the stream holds KV blocks
    finally:
        reply.close()  # closes the connection mid-stream
    wait_for(deployment.idle, 60, "KV blocks to return after the client disconnected")
    (after_stats,) = deployment.client.stats()
    assert after_stats.free_blocks == idle.free_blocks
    after = _metrics(replica_url)
    aborted = _sample(after, "mii_server:request_success_total", replica="0", finished_reason="abort")
    assert (
        aborted - _sample(before, "mii_server:request_success_total", replica="0", finished_reason="abort")
        == 1
    )
    generated = _sample(after, "mii_server:generation_tokens_total", replica="0") - _sample(
        before, "mii_server:generation_tokens_total", replica="0"
    )
    assert 1 <= generated < 2000
