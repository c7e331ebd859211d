"""Load balancer against in-process fake replicas: per-prompt round robin, order, streaming, failures."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from mii_server.errors import CapacityExceeded, Forbidden, InvalidRequest, ReplicaUnavailable, Unauthorized
from mii_server.generation.response import FinishReason
from mii_server.serving import grpc_common
from mii_server.serving.frontends.client import Client
from mii_server.serving.frontends.loop_thread import LoopThread
from mii_server.serving.routing.load_balancer import LoadBalancer
from mii_server.serving.security import ApiKeys, GrpcSecurity, call_metadata
from mii_server.wire import generation_pb2 as pb

from .fakes import ADMIN_TOKEN, FakeReplica, start_balancer, start_fake
from .helpers import free_port_block, wait_for


@pytest.fixture()
def cluster(bg: LoopThread) -> Iterator[tuple[Client, LoadBalancer, list[FakeReplica], list]]:
    base = free_port_block(3)
    fakes, servers = zip(*(bg.run(start_fake(f"r{i}", base + 1 + i)) for i in range(2)), strict=True)
    balancer, server = bg.run(start_balancer([f"127.0.0.1:{base + 1}", f"127.0.0.1:{base + 2}"], base))
    client = Client(f"127.0.0.1:{base}")
    yield client, balancer, list(fakes), list(servers)
    client.close()
    bg.run(server.stop(0))
    for s in servers:
        bg.run(s.stop(0))
    bg.run(balancer.close())


def test_prompts_are_spread_per_prompt_and_reassembled_in_order(cluster) -> None:
    client, _, fakes, _ = cluster
    prompts = [f"p{i}" for i in range(9)]
    out = client.generate(prompts)
    assert [r.generated_text.split("@")[0] for r in out] == prompts
    assert [r.generated_text.split("@")[1] for r in out] == ["r0", "r1"] * 4 + ["r0"]
    assert len(fakes[0].prompts) == 5 and len(fakes[1].prompts) == 4
    stats = client.stats()
    assert [s.prompts_routed for s in stats] == [5, 4] and all(s.healthy for s in stats)


def test_streaming_several_prompts_merges_chunks_in_order_per_prompt(cluster) -> None:
    client, _, _, _ = cluster
    prompts = ["alpha", "be", "gamma!"]
    pieces: dict[int, list[str]] = {}
    finals = {}
    for chunk in client.generate_stream(prompts):
        assert chunk.prompt_index not in finals, "a chunk after the final one"
        pieces.setdefault(chunk.prompt_index, []).append(chunk.generated_text)
        if chunk.finish_reason is not FinishReason.NONE:
            finals[chunk.prompt_index] = chunk
    texts = {i: "".join(p) for i, p in pieces.items()}
    assert texts == {0: "alpha@r0", 1: "be@r1", 2: "gamma!@r0"}


def test_a_down_replica_is_skipped(cluster, bg) -> None:
    client, balancer, _, servers = cluster
    bg.run(servers[1].stop(0))
    out = client.generate([f"q{i}" for i in range(4)])  # the first call finds r1 down and retries on r0
    assert all(r.generated_text.endswith("@r0") for r in out)
    assert not balancer.router.is_up(balancer.addresses[1])
    texts = ["", ""]
    for chunk in client.generate_stream(["ab", "cd"]):  # chunks that arrive together come merged
        texts[chunk.prompt_index] += chunk.generated_text
    assert texts == ["ab@r0", "cd@r0"]
    health = client.stats()
    assert [s.healthy for s in health] == [True, False]
    bg.run(servers[0].stop(0))
    with pytest.raises(ReplicaUnavailable):
        client.generate(["x"])


def test_replica_errors_reach_the_client_typed_with_their_message(cluster) -> None:
    client, _, _, _ = cluster
    with pytest.raises(InvalidRequest, match="prompt 'bad' refused by r"):
        client.generate(["ok", "bad", "ok"])
    with pytest.raises(CapacityExceeded, match="no KV blocks left"):
        list(client.generate_stream(["full"]))


def test_client_side_validation_happens_before_any_rpc(cluster) -> None:
    client, _, fakes, _ = cluster
    from mii_server.errors import UnknownArgument

    with pytest.raises(UnknownArgument, match="temprature"):
        client.generate(["a"], temprature=0.5)
    with pytest.raises(InvalidRequest):
        client.generate_stream(["a"], top_p=2.0)
    assert fakes[0].prompts == [] and fakes[1].prompts == []
    assert client.generate([]) == []


def test_leaving_a_stream_cancels_it_on_the_replica(cluster) -> None:
    client, _, fakes, _ = cluster
    stream = client.generate_stream(["endless"], max_new_tokens=999)
    next(stream)
    stream.close()
    wait_for(
        lambda: fakes[0].cancelled.is_set() or fakes[1].cancelled.is_set(), 10, "the replica to see cancel"
    )


def test_terminate_needs_the_admin_token_and_fans_out_to_every_replica(cluster) -> None:
    client, balancer, fakes, _ = cluster
    with pytest.raises(grpc.RpcError) as refused:
        client._stub.Terminate(pb.TerminateRequest())  # no token: nobody but the owner stops it
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError):
        client._stub.Terminate(pb.TerminateRequest(), metadata=call_metadata(admin_token="guess"))
    assert not balancer.stop_requested.is_set() and not any(f.terminated.is_set() for f in fakes)
    client._stub.Terminate(pb.TerminateRequest(), metadata=call_metadata(admin_token=ADMIN_TOKEN))
    assert all(f.terminated.is_set() for f in fakes)
    assert balancer.stop_requested.is_set()


def test_with_an_api_key_every_rpc_needs_it_but_health(bg: LoopThread) -> None:
    import asyncio

    base = free_port_block(2)
    security = GrpcSecurity(ApiKeys(["sesame"]), ADMIN_TOKEN)  # the whole deployment shares the key
    _, replica = bg.run(start_fake("r0", base + 1, security=security))
    balancer, server = bg.run(start_balancer([f"127.0.0.1:{base + 1}"], base, security=security))
    address = f"127.0.0.1:{base}"
    try:
        with Client(address, api_key="") as anonymous, Client(address, api_key="wrong") as wrong:
            for who in (anonymous, wrong):
                with pytest.raises(Unauthorized, match="API key"):
                    who.generate(["hi"])
                with pytest.raises(Unauthorized):
                    list(who.generate_stream(["hi"]))
                with pytest.raises(Unauthorized):
                    who.stats()
            assert grpc_common.is_serving(anonymous._channel)  # probes need no key
        with Client(address, api_key="sesame") as keyed:
            assert [r.generated_text for r in keyed.generate(["hi"])] == ["hi@r0"]
            assert "".join(c.generated_text for c in keyed.generate_stream(["hi"])) == "hi@r0"

            async def both_kinds_async() -> tuple[str, str]:  # the asyncio channel, as the front ends use it
                unary = (await keyed.agenerate(["yo"]))[0].generated_text
                streamed = "".join([c.generated_text async for c in keyed.agenerate_stream(["yo"])])
                return unary, streamed

            assert asyncio.run(both_kinds_async()) == ("yo@r0", "yo@r0")
            with pytest.raises(Forbidden, match="admin token"):
                keyed.terminate_server(wait=False)  # a key is not the admin token
        with pytest.raises(InvalidRequest, match="closed"):
            keyed.generate(["after close"])  # grpcio itself would crash the process here
        with Client(address, api_key="", admin_token=ADMIN_TOKEN) as owner:
            owner.terminate_server(wait=False)  # the owner's token alone stops it (mii-server stop, no key)
        assert balancer.stop_requested.is_set()
    finally:
        bg.run(server.stop(0))
        bg.run(replica.stop(0))
        bg.run(balancer.close())


def test_async_twins(cluster) -> None:
    import asyncio

    client, _, _, _ = cluster

    async def main() -> tuple[list[str], dict[int, str]]:
        out = await client.agenerate(["a", "b"])
        texts: dict[int, str] = {}
        async for chunk in client.agenerate_stream(["xy", "z"]):
            texts[chunk.prompt_index] = texts.get(chunk.prompt_index, "") + chunk.generated_text
        return [r.generated_text for r in out], texts

    plain, streamed = asyncio.run(main())
    assert [t.split("@")[0] for t in plain] == ["a", "b"]
    assert {i: t.split("@")[0] for i, t in streamed.items()} == {0: "xy", 1: "z"}


def test_many_threads_share_one_client(cluster) -> None:
    client, _, fakes, _ = cluster
    results: dict[int, list[str]] = {}

    def worker(t: int) -> None:
        results[t] = [
            r.generated_text.split("@")[0] for r in client.generate([f"t{t}-{i}" for i in range(5)])
        ]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == {t: [f"t{t}-{i}" for i in range(5)] for t in range(4)}
    assert len(fakes[0].prompts) == len(fakes[1].prompts) == 10


def test_a_request_waits_for_a_restarting_replica(bg: LoopThread) -> None:
    base = free_port_block(2)
    _, server = bg.run(start_fake("r0", base + 1))
    balancer, front = bg.run(start_balancer([f"127.0.0.1:{base + 1}"], base, replica_wait_s=60.0))
    client = Client(f"127.0.0.1:{base}")
    try:
        bg.run(server.stop(0))  # the only replica dies
        result: dict[str, object] = {}
        waiting = threading.Thread(target=lambda: result.update(out=client.generate(["back?"])))
        waiting.start()
        wait_for(lambda: not balancer.router.is_up(balancer.addresses[0]), 30, "the request to find the replica down")
        _, server = bg.run(start_fake("r0", base + 1))  # the supervisor restarted it

        def monitor_sees_it() -> bool:  # what the health monitor does every half second
            bg.run(balancer.probe_replicas())
            return balancer.router.is_up(balancer.addresses[0])

        wait_for(monitor_sees_it, 30, "the restarted replica to answer health")
        waiting.join(timeout=60)
        assert [r.generated_text for r in result["out"]] == ["back?@r0"]
    finally:
        client.close()
        bg.run(front.stop(0))
        bg.run(server.stop(0))
        bg.run(balancer.close())


def test_a_hung_replica_is_failed_over_and_health_answers_meanwhile(bg: LoopThread) -> None:
    """A replica that stops answering (SIGSTOP, a wedged engine) for the stall timeout: prompts it had
    not answered go to the other replica, a stream it had started ends with UNAVAILABLE, stats and
    health answer from the other at once, and the replica rejoins when it answers again."""
    base = free_port_block(3)
    (_, s0), (r1, s1) = (bg.run(start_fake(f"r{i}", base + 1 + i)) for i in range(2))
    balancer, server = bg.run(
        start_balancer([f"127.0.0.1:{base + 1}", f"127.0.0.1:{base + 2}"], base, stall_timeout_s=1.0)
    )

    async def nothing(any_up: bool, all_up: bool) -> None:
        pass

    monitor = asyncio.run_coroutine_threadsafe(balancer.monitor(nothing, interval_s=0.1), bg.loop)
    client = Client(f"127.0.0.1:{base}")
    try:
        r1.frozen = True
        started = time.monotonic()
        out = client.generate(["a", "b", "c", "d"])  # b and d go to r1 first
        assert [r.generated_text for r in out] == ["a@r0", "b@r0", "c@r0", "d@r0"]
        assert time.monotonic() - started < 10
        started = time.monotonic()
        stats = client.stats()
        assert time.monotonic() - started < 3  # the silent replica costs one stats deadline, not more
        assert [s.healthy for s in stats] == [True, False]

        r1.frozen = False
        wait_for(lambda: not balancer._links[f"127.0.0.1:{base + 2}"].stalled, 10, "r1 to rejoin")
        stream = client.generate_stream(["slow x" * 20, "slow y" * 20])  # one prompt on each replica
        seen = {next(stream).prompt_index, next(stream).prompt_index}
        assert seen == {0, 1}  # both replicas have produced output
        r1.frozen = True
        with pytest.raises(ReplicaUnavailable, match="hung"):
            list(stream)
    finally:
        r1.frozen = False
        monitor.cancel()
        client.close()
        for s in (server, s0, s1):
            bg.run(s.stop(0))
        bg.run(balancer.close())
