"""Integration: the OpenAI-compatible server of a real deployment (1 replica, CPU, demo model), driven by the
official ``openai`` package and raw HTTP; its metrics, health, request ids and disconnect handling.

One deployment for the module; every test leaves it idle (nothing running, every KV block free).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import requests

import mii_server
from mii_server.serving.control import registry
from mii_server.serving.frontends.client import Client
from mii_server.serving.frontends.http_common import server_version

from .helpers import free_port_block, sample, scrape, wait_for

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
    for path in ("/tokenizer_info", "/v1/models"):  # everything that is not a probe needs the key
        assert requests.get(deployment.base_url + path, timeout=10).status_code == 401
    assert requests.post(deployment.base_url + "/tokenize", json={"prompt": "a"}, timeout=10).status_code == 401
    # the key rule: probes, metrics and the version are open on every process
    assert requests.get(deployment.base_url + "/metrics", timeout=10).status_code == 200
    assert requests.get(deployment.base_url + "/version", timeout=10).json() == {"version": server_version()}
    assert requests.get(f"http://127.0.0.1:{deployment.metrics_port}/metrics", timeout=10).status_code == 200
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
    assert (err.value.param, err.value.code) == ("temperature", "invalid_value")
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, suffix="!")
    assert (err.value.param, err.value.code) == ("suffix", "unsupported_parameter")
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=MODEL, prompt=PROMPT, max_tokens="2")  # type: ignore[arg-type]
    assert (err.value.param, err.value.code) == ("max_tokens", "invalid_type")
    with pytest.raises(openai.BadRequestError, match="stream"):
        api.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, stream_options={"include_usage": True}
        )
    too_long = "fox " * 3000  # more tokens than the demo model's 2048-token context
    with pytest.raises(openai.BadRequestError, match="max_length") as err:
        api.completions.create(model=MODEL, prompt=too_long, max_tokens=2)
    # OpenAI's code once status.py carries ContextLengthExceeded across gRPC; until then the generic one
    assert err.value.code == "context_length_exceeded"
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
    assert bad_json.json()["error"]["code"] == "invalid_json"
    unknown_route = requests.get(deployment.base_url + "/v2/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert unknown_route.status_code == 404 and unknown_route.json()["error"]["code"] == "not_found"


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
    before, gw_before = scrape(replica_url), scrape(gateway_url, auth)
    api = deployment.openai()
    prompt_tokens = 0
    for i in range(3):
        reply = api.completions.create(
            model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.usage.completion_tokens == 5
        prompt_tokens += reply.usage.prompt_tokens
    ok = {"route": "/v1/completions", "status": "200"}

    def gateway_counted_all() -> dict | None:  # a reply is counted once its last byte is out: maybe after
        scraped = scrape(gateway_url, auth)  # the caller has read it
        counted = sample(scraped, "mii_server:http_requests_total", **ok)
        return scraped if counted - sample(gw_before, "mii_server:http_requests_total", **ok) >= 3 else None

    after = scrape(replica_url)
    gw_after = wait_for(gateway_counted_all, 10, "the gateway to count every request")

    def delta(name: str, m0: dict = before, m1: dict = after, **labels: str) -> float:
        return sample(m1, name, **labels) - sample(m0, name, **labels)

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
    assert sample(after, "mii_server:num_requests_running", replica="0") == 0
    total = sample(after, "mii_server:kv_cache_num_blocks", replica="0", model_name=MODEL)
    assert total > 0 and sample(after, "mii_server:kv_cache_blocks_used", replica="0") == 0
    # gauges do not wear a counter's suffix; every engine series names the model, as vLLM's
    engine = [(n, dict(lab)) for n, lab in after if n.startswith("mii_server:") and "replica" in dict(lab)]
    assert engine and all(labels["model_name"] == MODEL for _, labels in engine)
    assert not any(n.endswith("_total") for n in ("mii_server:kv_cache_num_blocks", "mii_server:num_requests_running"))
    assert ("mii_server:kv_cache_blocks_total", (("model_name", MODEL), ("replica", "0"))) not in after
    # one owner per metric: the front end counts its HTTP requests and reports no engine series
    assert delta("mii_server:http_requests_total", gw_before, gw_after, **ok) == 3
    assert not [n for n, _ in gw_after if n.startswith("mii_server:generation_tokens")]
    assert not [n for n, _ in gw_after if n.startswith("mii_server:request_failure")]


def test_client_disconnect_mid_stream_frees_kv_blocks(deployment: Deployment) -> None:
    replica_url = f"http://127.0.0.1:{deployment.metrics_port}/metrics"
    before = scrape(replica_url)
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
    after = scrape(replica_url)
    aborted = sample(after, "mii_server:request_success_total", replica="0", finished_reason="abort")
    assert (
        aborted - sample(before, "mii_server:request_success_total", replica="0", finished_reason="abort")
        == 1
    )
    generated = sample(after, "mii_server:generation_tokens_total", replica="0") - sample(
        before, "mii_server:generation_tokens_total", replica="0"
    )
    assert 1 <= generated < 2000


def _abandon(deployment: Deployment, path: str, body: dict, prompts: int) -> None:
    """Send ``body`` from a client process that is killed (SIGKILL, as a killed curl) once the replica
    has received its ``prompts`` prompts and holds KV blocks for them; then wait until the replica is
    idle again."""
    (idle,) = deployment.client.stats()

    def holding() -> bool:
        (now,) = deployment.client.stats()
        # why prompts_received: with a seed, n prompts are n upstream calls; a kill after the first
        # few would leave the rest never sent, and so never aborted
        return now.prompts_received - idle.prompts_received >= prompts and now.free_blocks < idle.free_blocks

    script = (
        "import sys, requests; requests.post(sys.argv[1], data=sys.argv[2], "
        "headers={'Authorization': 'Bearer ' + sys.argv[3], 'Content-Type': 'application/json'}, timeout=120)"
    )
    caller = subprocess.Popen([sys.executable, "-c", script, deployment.base_url + path, json.dumps(body), KEY])
    try:
        wait_for(holding, 60, "the request's prompts to hold KV")
    finally:
        caller.kill()
        caller.wait()
    wait_for(deployment.idle, 60, "KV blocks to return after the client was killed")


@pytest.mark.parametrize(
    ("path", "body", "prompts"),
    [
        ("/v1/completions", {"prompt": PROMPT}, 1),
        ("/v1/completions", {"prompt": PROMPT, "n": 8}, 8),
        ("/v1/completions", {"prompt": PROMPT, "n": 8, "seed": 5}, 8),  # eight upstream calls
        ("/v1/chat/completions", {"messages": MESSAGES}, 1),
    ],
)
def test_an_abandoned_non_streaming_request_aborts_its_prompts(
    deployment: Deployment, path: str, body: dict, prompts: int
) -> None:
    replica_url = f"http://127.0.0.1:{deployment.metrics_port}/metrics"
    before = scrape(replica_url)
    _abandon(deployment, path, {"model": MODEL, "max_tokens": 2000, "ignore_eos": True, **body}, prompts)
    after = scrape(replica_url)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("mii_server:request_success_total", finished_reason="abort") == prompts
    assert delta("mii_server:request_success_total", finished_reason="length") == 0
    assert delta("mii_server:generation_tokens_total") < 2000 * prompts


# ---- log-probabilities, echo, sampling controls -------------------------------------------------------


def _close(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and abs(a - b) < 1e-3)


def test_completion_logprobs_are_the_engines(deployment: Deployment, pipe: object) -> None:
    (want,) = pipe([PROMPT], max_new_tokens=6, do_sample=False, logprobs=2)
    got = deployment.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert lp.tokens == [e.token for e in want.logprobs]
    assert all(_close(a, e.logprob) for a, e in zip(lp.token_logprobs, want.logprobs, strict=True))
    for top, e in zip(lp.top_logprobs, want.logprobs, strict=True):
        # the chosen token and the 2 most likely (fewer keys when they coincide or decode alike)
        assert e.token in top and 1 <= len(top) <= 3
        assert all(_close(top[t.token], t.logprob) for t in e.top_logprobs if t.token != e.token)
    offsets = lp.text_offset
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], lp.tokens))


def test_echo_logprobs_give_the_prompts_log_likelihood(deployment: Deployment, pipe: object) -> None:
    """What lm-evaluation-harness's local-completions sends for a log-likelihood request."""
    (want,) = pipe([PROMPT], max_new_tokens=1, do_sample=False, prompt_logprobs=1, logprobs=1)
    api = deployment.openai()
    for max_tokens in (1, 0):
        got = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0, logprobs=1, echo=True, seed=1234)
        choice = got.choices[0]
        lp = choice.logprobs
        n = want.prompt_length
        assert len(lp.tokens) == n + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
        assert all(_close(a, e.logprob) for a, e in zip(lp.token_logprobs[1:n], want.prompt_logprobs[1:], strict=True))
        assert lp.tokens[1:n] == [e.token for e in want.prompt_logprobs[1:]]
        assert choice.text == PROMPT + (want.generated_text if max_tokens else "")
        assert got.usage.completion_tokens == max_tokens and got.usage.prompt_tokens == n
        assert choice.finish_reason == "length"
    chat = api.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_streamed_logprobs_add_up_to_the_whole(deployment: Deployment) -> None:
    api = deployment.openai()
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1, "echo": True}
    whole = api.completions.create(**kwargs).choices[0]
    tokens, values, offsets, text = [], [], [], ""
    for chunk in api.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text and tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert all(_close(a, b) for a, b in zip(values, whole.logprobs.token_logprobs, strict=True))
    chat = list(
        api.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, stream=True
        )
    )
    entries = [e for c in chat if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 5


def test_sampling_controls_are_honoured(deployment: Deployment, pipe: object) -> None:
    api = deployment.openai()
    controls = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3}
    (want,) = pipe([PROMPT], max_new_tokens=24, do_sample=False, ignore_eos=True, **controls)
    (plain,) = pipe([PROMPT], max_new_tokens=24, do_sample=False, ignore_eos=True)
    assert want.token_ids != plain.token_ids  # the penalties change this greedy output
    got = api.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, presence_penalty=1.5, frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.3, "ignore_eos": True},
    )  # fmt: skip
    assert got.choices[0].text == want.generated_text
    # logit_bias forces a token; min_p is accepted
    forced = api.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={"65": 100},
        extra_body={"min_p": 0.1, "ignore_eos": True}, logprobs=0,
    )  # fmt: skip
    assert [forced.choices[0].logprobs.tokens] == [[pipe.tokenizer.decode([65])] * 3]


def test_cached_prompt_tokens_are_reported(deployment: Deployment) -> None:
    api = deployment.openai()
    prompt = "A long shared prefix that fills several KV blocks. " * 8
    first = api.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = api.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens


# ---- token ids, tokenizer endpoints, models, roles -------------------------------------------------


def test_token_id_prompts(deployment: Deployment) -> None:
    api = deployment.openai()
    ids = deployment.client.tokenize(PROMPT)[0].token_ids
    by_text = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = api.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert by_ids.choices[0].text == PROMPT + by_text.choices[0].text  # echo gives the ids' text
    both = api.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=2, temperature=0)
    assert [c.index for c in both.choices] == [0, 1] and both.usage.prompt_tokens == len(ids) + 3
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        api.completions.create(model=MODEL, prompt=[ids[0], 10**9], max_tokens=2)
    assert deployment.client.generate([ids], max_new_tokens=6, do_sample=False)[0].generated_text == by_text.choices[0].text


def test_tokenizer_endpoints(deployment: Deployment, pipe: object) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    url = deployment.base_url
    tok = requests.post(url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}, headers=auth).json()
    assert tok["tokens"] == pipe.tokenizer.encode(PROMPT) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 2048 and tok["token_strs"] == [pipe.tokenizer.decode([t]) for t in tok["tokens"]]
    chat = requests.post(url + "/tokenize", json={"messages": MESSAGES}, headers=auth).json()
    rendered = deployment.client.apply_chat_template([(m["role"], m["content"]) for m in MESSAGES])
    assert chat["tokens"] == pipe.tokenizer.encode(rendered, add_special_tokens=False)
    back = requests.post(url + "/detokenize", json={"tokens": tok["tokens"]}, headers=auth).json()
    assert back == {"prompt": PROMPT}
    bad = requests.post(url + "/detokenize", json={"tokens": [10**9]}, headers=auth)
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    info = requests.get(url + "/tokenizer_info", headers=auth).json()
    assert info["eos_token"] == pipe.tokenizer.eos_token and info["chat_template"] == pipe.tokenizer.chat_template
    assert info["model_max_length"] == 2048 and info["vocab_size"] == len(pipe.tokenizer)


def test_models_retrieve_and_the_developer_role(deployment: Deployment) -> None:
    api = deployment.openai()
    assert api.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("other")
    as_system = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    developer = [{"role": "developer", "content": MESSAGES[0]["content"]}, MESSAGES[1]]
    as_developer = api.chat.completions.create(model=MODEL, messages=developer, max_tokens=6, temperature=0)
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens
