"""Unit: replica targets (host:port, dns:///NAME:PORT) and their resolution, with resolvers the test controls."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mii_server.errors import InvalidRequest
from mii_server.serving.routing.discovery import (
    ReplicaDiscovery,
    Target,
    default_resolver,
    hosts_file_resolver,
    parse_target,
    parse_targets,
    system_resolver,
)


def test_targets_parse_and_print_back() -> None:
    assert parse_target("10.0.0.1:50051") == Target("10.0.0.1", 50051, dns=False)
    assert parse_target("dns:///mii-server-replica:50051") == Target("mii-server-replica", 50051, dns=True)
    assert parse_target("[::1]:7") == Target("::1", 7, dns=False)
    assert str(parse_target("[::1]:7")) == "[::1]:7"
    assert str(parse_target(" dns:///r.svc:9 ")) == "dns:///r.svc:9"
    assert parse_targets(["a:1,dns:///b:2", "c:3"]) == [Target("a", 1, False), Target("b", 2, True), Target("c", 3, False)]


@pytest.mark.parametrize(
    "bad", ["replica", "replica:", ":50051", "dns:///replica", "dns://8.8.8.8/replica:1", "http://r:1", "r:70000"]
)
def test_bad_targets_are_refused_naming_the_entry(bad: str) -> None:
    with pytest.raises(InvalidRequest, match="replica address"):
        parse_target(bad)


def test_no_target_at_all_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="no replica address"):
        parse_targets([" , "])


def test_names_are_resolved_afresh_and_fixed_addresses_kept() -> None:
    answers: dict[str, list[str] | OSError] = {"replicas": ["127.0.0.2:9", "127.0.0.3:9"]}
    asked: list[tuple[str, int]] = []

    def resolver(name: str, port: int) -> list[str]:
        asked.append((name, port))
        answer = answers[name]
        if isinstance(answer, OSError):
            raise answer
        return answer

    discovery = ReplicaDiscovery(parse_targets(["dns:///replicas:9", "10.0.0.9:1"]), resolver)
    assert discovery.dynamic
    assert asyncio.run(discovery.resolve()) == ["127.0.0.2:9", "127.0.0.3:9", "10.0.0.9:1"]
    answers["replicas"] = ["127.0.0.3:9", "127.0.0.4:9"]  # one replica left, one came
    assert asyncio.run(discovery.resolve()) == ["127.0.0.3:9", "127.0.0.4:9", "10.0.0.9:1"]
    answers["replicas"] = OSError("the DNS server did not answer")  # unknown: keep the last answer
    assert asyncio.run(discovery.resolve()) == ["127.0.0.3:9", "127.0.0.4:9", "10.0.0.9:1"]
    answers["replicas"] = []  # known to have no address: no replica from it
    assert asyncio.run(discovery.resolve()) == ["10.0.0.9:1"]
    assert asked == [("replicas", 9)] * 4  # the fixed address is never looked up


def test_fixed_addresses_only_are_not_dynamic() -> None:
    discovery = ReplicaDiscovery(parse_targets(["a:1", "b:2"]), lambda name, port: [])
    assert not discovery.dynamic
    assert asyncio.run(discovery.resolve()) == ["a:1", "b:2"]


def test_hosts_file_resolver_reads_the_file_at_every_call(tmp_path: Path, monkeypatch) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2 replicas other  # a comment\n127.0.0.3 replicas\n::1 v6\n# 127.0.0.9 replicas\n")
    resolve = hosts_file_resolver(str(hosts))
    assert resolve("replicas", 5) == ["127.0.0.2:5", "127.0.0.3:5"]
    assert resolve("v6", 5) == ["[::1]:5"] and resolve("nobody", 5) == []
    hosts.write_text("127.0.0.3 replicas\n")
    assert resolve("replicas", 5) == ["127.0.0.3:5"]
    monkeypatch.setenv("MII_SERVER_HOSTS_FILE", str(hosts))
    assert default_resolver()("replicas", 6) == ["127.0.0.3:6"]
    monkeypatch.delenv("MII_SERVER_HOSTS_FILE")
    assert default_resolver() is system_resolver


def test_the_system_resolver_answers_for_localhost() -> None:
    assert "127.0.0.1:5" in system_resolver("localhost", 5)
