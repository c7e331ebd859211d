"""Helpers for server tests: free ports, process trees, waiting on conditions (never sleep-and-hope)."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path

from mii_server.serving.control.ports import port_is_free

Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """A base port such that base..base+count-1 are all free now (random, so parallel runs differ)."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        # below Linux's ephemeral range (32768+): ports the OS hands out to client sockets and to
        # port-0 binds (TP ranks' store and step channel) cannot land on a port the test reserved
        base = rng.randrange(20000, 32700 - count)
        if all(port_is_free(host, base + i) for i in range(count)):
            return base
    raise RuntimeError("no free block of ports found")


def wait_for(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> object:
    """Poll ``condition`` until truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


def deployment_processes(name: str, registry_dir: str, role: str | None = None) -> list[int]:
    """Pids of live ``mii_server.launch`` processes of deployment ``name`` in ``registry_dir`` (of
    ``role`` only, when given).

    Both must match: another test run on this machine may serve a deployment of the same name.
    """
    from mii_server.launch.spec import RankSpec, decode
    from mii_server.serving.control.registry import pid_alive

    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mii_server.launch" not in argv or b"--config" not in argv or b"--role" not in argv:
            continue
        its_role = argv[argv.index(b"--role") + 1].decode()
        if role is not None and its_role != role:
            continue
        try:
            spec = decode(its_role, argv[argv.index(b"--config") + 1].decode())
        except ValueError:  # a process of another checkout, whose config this code does not know
            continue
        owner = spec.replica if isinstance(spec, RankSpec) else spec.deployment  # a TP rank: its replica's
        same = owner.deployment_name == name and owner.registry_dir == registry_dir
        if same and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def listening_addresses(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the processes ``pids`` listen on (IPv4 and IPv6, from /proc)."""
    import ipaddress

    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:  # the process is gone
            continue
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints the address as 32-bit words in host (little-endian) order
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, width // 2, 4))
            address = ipaddress.ip_address(words)
            mapped = getattr(address, "ipv4_mapped", None)  # a dual-stack socket bound to an IPv4 address
            found.add((str(mapped or address), int(hex_port, 16)))
    return found


def scrape(url: str, headers: dict[str, str] | None = None) -> Metrics:
    """A Prometheus ``/metrics`` page as {(sample name, sorted labels): value}."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url, headers=headers, timeout=10).text
    out: Metrics = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    """The sum of ``name``'s series whose labels include ``labels`` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, lab), v in metrics.items() if n == name and want <= set(lab))
