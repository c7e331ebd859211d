"""Integration: each role of a deployment as its own process, started exactly as the Kubernetes manifests
start them (their container arguments read from ``deploy/kubernetes/base``, only the addresses changed):
two ``replica`` (demo model), one ``load-balancer`` following ``dns:///replicas.test:PORT``, one
``gateway`` with both front ends.

DNS: every replica binds its own loopback address (127.0.0.2, .3, .4) on the same port, as pods behind
a headless Service, and the load balancer resolves the name from a hosts file the test rewrites
(``MII_SERVER_HOSTS_FILE``), so replicas are added and removed while requests flow.

Tests run in file order and share the processes; the last one stops them all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from mii_server.generation.response import FinishReason
from mii_server.serving import grpc_common
from mii_server.serving.control.ports import port_is_free
from mii_server.serving.frontends.client import Client

from .helpers import free_port_block, wait_for

pytestmark = pytest.mark.integration

BASE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base"
NAME = "roles-demo"
KEY = "roles-test-key"
REPLICA_HOSTS = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4"}
GREEDY = {"max_new_tokens": 8, "do_sample": False}
LOAD = {"max_new_tokens": 24, "ignore_eos": True}  # every reply has exactly 24 tokens
PROMPTS = ["Hello there", "The quick brown fox", "A model server", "Numbers 1 2 3"]
START_S = 120  # a replica imports torch and loads the demo model; CI's two cores are shared
NEW_REPLICA_TRAFFIC_S = 10  # "receives traffic within seconds" once it is in the DNS answer


def manifest_args(role: str) -> list[list[str]]:
    """The container arguments of a role's Deployment in the base manifests (one list per container)."""
    docs = [d for d in yaml.safe_load_all((BASE / f"{role}.yaml").read_text()) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    return [[str(a) for a in c["args"]] for c in deployment["spec"]["template"]["spec"]["containers"]]


def with_values(args: list[str], **values: object) -> list[str]:
    """``args`` with the value after each ``--flag-name`` replaced (every one must be present)."""
    out = list(args)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        out[out.index(flag) + 1] = str(value)
    return out


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Cluster:
    root: Path
    replica_port: int
    metrics_port: int
    lb_port: int
    rest_port: int
    openai_port: int
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def hosts(self) -> Path:
        return self.root / "hosts"

    @property
    def lb(self) -> str:
        return f"127.0.0.1:{self.lb_port}"

    def replica(self, key: str) -> str:
        return f"{REPLICA_HOSTS[key]}:{self.replica_port}"

    def start(self, name: str, args: list[str], **env: str) -> Proc:
        log = self.root / f"{name}.log"
        popen = subprocess.Popen(
            [sys.executable, "-m", "mii_server.cli", *args],  # the images' ENTRYPOINT is `mii-server`
            stdin=subprocess.DEVNULL,
            stdout=open(log, "wb"),  # noqa: SIM115 - the child owns it
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
        self.procs[name] = Proc(name, popen, log)
        return self.procs[name]

    def start_replica(self, key: str) -> Proc:
        (args,) = manifest_args("replica")
        args = with_values(
            args, config=self.config, host=REPLICA_HOSTS[key], port=self.replica_port, metrics_port=self.metrics_port
        )
        return self.start(f"replica-{key}", args)

    def set_dns(self, *keys: str) -> None:
        """The name's answer: these replicas (written whole, so a reader never sees half a file)."""
        staging = self.hosts.with_suffix(".new")
        staging.write_text("".join(f"{REPLICA_HOSTS[k]} replicas.test\n" for k in keys))
        staging.replace(self.hosts)

    def wait_serving(self, address: str, service: str, what: str) -> None:
        channel = grpc_common.channel(address)
        try:
            wait_for(lambda: self._alive() and grpc_common.is_serving(channel, 1.0, service), START_S, what)
        finally:
            channel.close()

    def _alive(self) -> bool:
        dead = {n: p for n, p in self.procs.items() if p.popen.poll() is not None and not n.startswith("gone-")}
        if dead:
            raise AssertionError("\n".join(f"{n} exited with {p.popen.returncode}:\n{p.tail()}" for n, p in dead.items()))
        return True


def _free_port_on_every_replica_host() -> int:
    while True:
        port = free_port_block(1)
        if all(port_is_free(h, port) for h in REPLICA_HOSTS.values()):
            return port


@pytest.fixture(scope="module")
def cluster(registry_env: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("roles")
    base = free_port_block(4)
    c = Cluster(root, _free_port_on_every_replica_host(), base, base + 1, base + 2, base + 3)
    c.config.write_text(
        json.dumps(
            {
                "deployment_name": NAME,
                "served_model_name": "mii-server-demo",
                "replica_wait_s": 30,
                "resolve_interval_s": 0.2,
                "model_config": {"device": "cpu", "max_length": 2048, "kv_cache": {"cpu_default_bytes": 2**24}},
            }
        )
    )
    c.set_dns("a", "b")
    try:
        c.start_replica("a")
        c.start_replica("b")
        (lb_args,) = manifest_args("load-balancer")
        lb_args = with_values(
            lb_args, config=c.config, host="127.0.0.1", port=c.lb_port, replicas=f"dns:///replicas.test:{c.replica_port}"
        )
        c.start("load-balancer", lb_args, MII_SERVER_HOSTS_FILE=str(c.hosts))
        rest_args, openai_args = manifest_args("gateway")  # the containers `rest` and `openai`, in one process
        assert "--openai-port" in openai_args
        gateway_args = with_values(
            rest_args, config=c.config, host="127.0.0.1", load_balancer=c.lb, rest_port=c.rest_port
        ) + ["--openai-port", str(c.openai_port)]
        c.start("gateway", gateway_args, MII_SERVER_API_KEY=KEY)
        for key in ("a", "b"):
            c.wait_serving(c.replica(key), grpc_common.SERVICE_NAME, f"replica {key} to load")
        c.wait_serving(c.lb, grpc_common.ALL_REPLICAS_SERVICE, "the load balancer to route to both replicas")
        for port in (c.rest_port, c.openai_port):
            wait_for(lambda p=port: c._alive() and _get(p, "/healthz")[0] == 200, START_S, f"the gateway on {port}")
        yield c
    finally:
        for proc in c.procs.values():
            if proc.popen.poll() is None:
                os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()


def _get(port: int, path: str, key: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError:
        return 0, ""


def _post(url: str, body: dict) -> dict | list:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    request.add_header("Authorization", f"Bearer {KEY}")
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


def test_every_front_end_generates_and_the_probes_answer(cluster: Cluster) -> None:
    with Client(cluster.lb) as client:
        grpc_texts = [r.generated_text for r in client.generate(PROMPTS, **GREEDY)]
        assert all(r.prompts_routed == 2 for r in client.stats())  # per-prompt round robin over both
    rest = _post(f"http://127.0.0.1:{cluster.rest_port}/mii/{NAME}", {"prompts": PROMPTS, **GREEDY})
    assert [r["generated_text"] for r in rest] == grpc_texts
    for prompt, want in zip(PROMPTS, grpc_texts, strict=True):
        body = {"model": "mii-server-demo", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        reply = _post(f"http://127.0.0.1:{cluster.openai_port}/v1/completions", body)
        assert reply["choices"][0]["text"] == want and reply["usage"]["completion_tokens"] == 8
    # what the manifests' probes ask
    for key in ("a", "b"):
        channel = grpc_common.channel(cluster.replica(key))
        assert grpc_common.is_serving(channel, service="") and grpc_common.is_serving(channel, service=grpc_common.SERVICE_NAME)
        channel.close()
        metrics = f"http://{REPLICA_HOSTS[key]}:{cluster.metrics_port}"
        with urllib.request.urlopen(metrics + "/metrics", timeout=10) as reply:
            assert "mii_server:generation_tokens_total" in reply.read().decode()
        with urllib.request.urlopen(metrics + "/health", timeout=10) as reply:
            assert json.loads(reply.read())["state"] == "serving"
    channel = grpc_common.channel(cluster.lb)
    assert grpc_common.is_serving(channel, service="")
    channel.close()
    for port in (cluster.rest_port, cluster.openai_port):
        assert _get(port, "/health")[0] == 200  # no key needed
    assert _get(cluster.openai_port, "/v1/models")[0] == 401
    assert _get(cluster.openai_port, "/v1/models", KEY)[0] == 200


class Load:
    """A few concurrent clients (gRPC and REST) generating until stopped; every failure is kept."""

    def __init__(self, cluster: Cluster, clients: int = 3) -> None:
        self.done = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._client = Client(cluster.lb)
        url = f"http://127.0.0.1:{cluster.rest_port}/mii/{NAME}"
        self._threads = [threading.Thread(target=self._grpc, args=(t,)) for t in range(clients)]
        self._threads.append(threading.Thread(target=self._rest, args=(url,)))
        for t in self._threads:
            t.start()

    def _loop(self, call) -> None:
        while not self._stop.is_set():
            try:
                out = call()
                lengths = [r["generated_length"] if isinstance(r, dict) else r.generated_length for r in out]
                assert lengths == [24, 24], lengths
            except BaseException as exc:  # noqa: BLE001 - every failure is the test's finding
                with self._lock:
                    self.errors.append(exc)
                return
            with self._lock:
                self.done += 1

    def _grpc(self, t: int) -> None:
        self._loop(lambda: self._client.generate([f"client {t}: {p}" for p in PROMPTS[:2]], **LOAD))

    def _rest(self, url: str) -> None:
        self._loop(lambda: _post(url, {"prompts": PROMPTS[2:], **LOAD}))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
        self._client.close()

    def wait_done(self, more: int, what: str) -> None:
        target = self.done + more
        wait_for(lambda: self.done >= target or self.errors, 120, what)
        assert self.errors == [], self.errors


def test_a_killed_replica_costs_no_request_and_a_new_one_gets_traffic(cluster: Cluster) -> None:
    load = Load(cluster)
    try:
        load.wait_done(8, "requests to flow")
        with Client(cluster.lb) as client:
            assert all(s.prompts_routed > 2 for s in client.stats())  # both replicas take the load
            killed = cluster.procs.pop("replica-b")
            os.killpg(killed.popen.pid, signal.SIGKILL)  # a crash: no drain, its calls fail mid-way
            killed.popen.wait()
            load.wait_done(12, "requests to go on without replica b")
            lb_log = cluster.procs["load-balancer"].log.read_text()
            assert f"replica {cluster.replica('b')} unavailable" in lb_log  # its prompts were retried on a
            cluster.start_replica("c")
            cluster.wait_serving(cluster.replica("c"), grpc_common.SERVICE_NAME, "replica c to load")
            cluster.set_dns("a", "c")  # as a headless Service does: the new pod once ready, the dead one gone
            added = time.monotonic()
            with Client(cluster.replica("c")) as direct:
                wait_for(lambda: direct.stats()[0].prompts_received > 0, NEW_REPLICA_TRAFFIC_S, "replica c to get traffic")
            took = time.monotonic() - added
            assert [s.address for s in client.stats()] == [cluster.replica("a"), cluster.replica("c")]
        load.wait_done(4, "requests to go on over a and c")
    finally:
        load.stop()
    assert load.errors == []
    print(f"replica c received its first prompt {took:.2f} s after it entered the DNS answer")


def test_a_replica_leaving_the_name_finishes_its_streams_and_exits_0(cluster: Cluster) -> None:
    long = {"max_new_tokens": 1900, "ignore_eos": True, "do_sample": False}
    with Client(cluster.lb) as client, Client(cluster.replica("a")) as direct:
        stream = client.generate_stream(["one stream on a", "one on c"], **long)  # one prompt per replica
        chunks = [next(stream)]
        cluster.set_dns("c")  # a's pod is deleted: it leaves the DNS answer first ...
        wait_for(lambda: [s.address for s in client.stats()] == [cluster.replica("c")], 10, "the balancer to drop a")
        assert direct.stats()[0].running == 1, "the stream on replica a ended before the test could stop a"
        leaving = cluster.procs.pop("replica-a")
        leaving.popen.send_signal(signal.SIGTERM)  # ... then, after the preStop sleep, SIGTERM
        assert all(r.generated_length == 8 for r in client.generate(PROMPTS, **GREEDY))  # c serves meanwhile
        chunks += list(stream)
        assert leaving.popen.wait(timeout=60) == 0, leaving.tail()
    finals = [c for c in chunks if c.finish_reason is not FinishReason.NONE]
    assert sorted(c.prompt_index for c in finals) == [0, 1]
    assert all(c.generated_length == 1900 and c.finish_reason is FinishReason.LENGTH for c in finals)
    log = leaving.log.read_text()
    assert log.index("stopping: finishing open requests") < log.rindex("finished reason=length")


def _sse(url: str, body: dict) -> Iterator[dict]:
    """The JSON events of a server-sent event stream, until [DONE]."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    request.add_header("Authorization", f"Bearer {KEY}")
    with urllib.request.urlopen(request, timeout=120) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                return
            if line.startswith("data: "):
                yield json.loads(line[len("data: ") :])


def test_stopped_front_ends_finish_their_streams_and_every_role_exits_0(cluster: Cluster) -> None:
    long = {"max_new_tokens": 1900, "ignore_eos": True}
    with Client(cluster.lb) as client:
        grpc_stream = client.generate_stream(["through the load balancer"], **long)
        rest_stream = _sse(
            f"http://127.0.0.1:{cluster.rest_port}/mii/{NAME}", {"prompts": ["through REST"], "stream": True, **long}
        )
        openai_stream = _sse(
            f"http://127.0.0.1:{cluster.openai_port}/v1/completions",
            {"model": "mii-server-demo", "prompt": "through OpenAI", "max_tokens": 1900, "ignore_eos": True, "stream": True},
        )
        firsts = [next(grpc_stream), next(rest_stream), next(openai_stream)]
        assert all(firsts)
        for name in ("gateway", "load-balancer"):  # both drain with streams open through them
            cluster.procs[name].popen.send_signal(signal.SIGTERM)
        wait_for(lambda: _get(cluster.rest_port, "/healthz")[0] == 0, 30, "the REST port to refuse new connections")
        grpc_chunks = list(grpc_stream)
        rest_chunks = list(rest_stream)
        openai_chunks = list(openai_stream)
    assert grpc_chunks[-1].generated_length == 1900 and grpc_chunks[-1].finish_reason is FinishReason.LENGTH
    assert rest_chunks[-1]["generated_length"] == 1900 and rest_chunks[-1]["finish_reason"] == "length"
    assert openai_chunks[-1]["choices"][0]["finish_reason"] == "length"
    for name in ("gateway", "load-balancer"):
        proc = cluster.procs[name]
        assert proc.popen.wait(timeout=60) == 0, f"{name}:\n{proc.tail()}"
    for proc in cluster.procs.values():
        proc.popen.send_signal(signal.SIGTERM)
    for proc in cluster.procs.values():
        assert proc.popen.wait(timeout=60) == 0, f"{proc.name}:\n{proc.tail()}"
    for port in (cluster.lb_port, cluster.rest_port, cluster.openai_port):
        assert port_is_free("127.0.0.1", port)
