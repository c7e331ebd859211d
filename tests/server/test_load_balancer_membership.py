"""Load balancer over a replica set that changes while requests flow (in-process fake replicas, each on
its own loopback address and the same port, as pods behind a headless Service; the DNS answer is a
resolver the test controls)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mii_server.serving.frontends.client import Client
from mii_server.serving.frontends.loop_thread import LoopThread
from mii_server.serving.routing.discovery import ReplicaDiscovery, parse_targets
from mii_server.serving.routing.load_balancer import LoadBalancer

from .fakes import start_balancer, start_fake
from .helpers import free_port_block, wait_for

HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
FOLLOW_S = 0.05


@pytest.fixture()
def fleet(bg: LoopThread):
    """Three fakes r0..r2 on HOSTS:port; a balancer following dns:///replicas:port, which names r0 and r1."""
    port, lb_port = free_port_block(1), free_port_block(1)
    fakes, servers = zip(*(bg.run(start_fake(f"r{i}", port, host)) for i, host in enumerate(HOSTS)), strict=True)
    answer = [f"{HOSTS[0]}:{port}", f"{HOSTS[1]}:{port}"]
    discovery = ReplicaDiscovery(parse_targets([f"dns:///replicas:{port}"]), lambda name, p: list(answer))

    async def start() -> tuple[LoadBalancer, object, asyncio.Task]:
        balancer, server = await start_balancer(await discovery.resolve(), lb_port)
        return balancer, server, asyncio.ensure_future(balancer.follow(discovery, FOLLOW_S))

    balancer, server, following = bg.run(start())
    client = Client(f"127.0.0.1:{lb_port}")
    yield client, balancer, list(fakes), answer, port
    client.close()
    bg.loop.call_soon_threadsafe(following.cancel)
    bg.run(server.stop(0))
    for s in servers:
        bg.run(s.stop(0))
    bg.run(balancer.close())


def _served_by(texts: list[str]) -> set[str]:
    return {t.rsplit("@", 1)[1] for t in texts}


def test_replicas_are_added_and_dropped_as_the_name_resolves(fleet) -> None:
    client, balancer, fakes, answer, port = fleet
    r = [f"{h}:{port}" for h in HOSTS]
    assert _served_by([x.generated_text for x in client.generate([f"p{i}" for i in range(4)])]) == {"r0", "r1"}
    answer.append(r[2])  # a replica comes
    wait_for(lambda: balancer.addresses == r, 10, "the balancer to add r2")
    assert _served_by([x.generated_text for x in client.generate([f"q{i}" for i in range(6)])]) == {"r0", "r1", "r2"}
    assert [s.address for s in client.stats()] == r  # the Stats RPC reports the current set
    answer.remove(r[0])  # a replica goes
    wait_for(lambda: balancer.addresses == r[1:], 10, "the balancer to drop r0")
    before = len(fakes[0].prompts)
    assert _served_by([x.generated_text for x in client.generate([f"s{i}" for i in range(6)])]) == {"r1", "r2"}
    assert len(fakes[0].prompts) == before
    stats = client.stats()
    assert [s.address for s in stats] == r[1:] and [s.replica_index for s in stats] == [0, 1]
    assert all(s.healthy for s in stats)


def test_a_stream_open_on_a_dropped_replica_goes_on(fleet) -> None:
    client, balancer, fakes, answer, port = fleet
    stream = client.generate_stream(["endless"], max_new_tokens=999)  # the first prompt goes to r0
    next(stream)
    assert fakes[0].prompts == ["endless"]
    answer.remove(f"{HOSTS[0]}:{port}")
    wait_for(lambda: f"{HOSTS[0]}:{port}" not in balancer.addresses, 10, "the balancer to drop r0")
    for _ in range(20):  # still flowing from r0 after it left the set: its channel stays open
        assert next(stream).generated_text == "."
    stream.close()
    wait_for(lambda: fakes[0].cancelled.is_set(), 10, "r0 to see the stream cancelled")


def test_requests_wait_for_a_replica_to_appear(fleet) -> None:
    client, balancer, _, answer, port = fleet
    balancer.replica_wait_s = 30.0
    answer.clear()  # no replica at all (a headless Service with no ready pod)
    wait_for(lambda: balancer.addresses == [], 10, "the balancer to drop every replica")
    result: dict[str, object] = {}
    waiting = threading.Thread(target=lambda: result.update(out=client.generate(["anyone?"])))
    waiting.start()
    wait_for(lambda: balancer.waiting_requests == 1, 10, "the request to wait for a replica")
    answer.append(f"{HOSTS[2]}:{port}")
    waiting.join(timeout=30)
    assert [x.generated_text for x in result["out"]] == ["anyone?@r2"]
    assert balancer.waiting_requests == 0
