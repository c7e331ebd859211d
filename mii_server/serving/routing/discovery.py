"""Which replicas the load balancer routes to: fixed ``host:port`` addresses and ``dns:///NAME:PORT`` names.

A ``dns:///`` name is resolved again every ``interval_s`` (a Kubernetes headless Service answers one
address per ready pod), so replicas that come and go are followed; a fixed address is dialed as
given (gRPC resolves a host name in it itself). Plain Python, no torch.

Resolution goes through a ``Resolver``: ``(name, port) -> ["ip:port", ...]``, an empty list when the
name has no address (NXDOMAIN: a headless Service with no ready pod), ``OSError`` when the answer is
unknown (the DNS server did not answer), in which case the name's previous addresses are kept.
``default_resolver()`` is the system's (``getaddrinfo``), or, when ``$MII_SERVER_HOSTS_FILE`` names
a file, that file in ``/etc/hosts`` form, read afresh at every resolution: tests use it to make a
name resolve to several loopback addresses and change the answer while the load balancer runs.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...errors import InvalidRequest

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"
HOSTS_FILE_ENV = "MII_SERVER_HOSTS_FILE"

Resolver = Callable[[str, int], list[str]]


@dataclass(frozen=True)
class Target:
    """One entry of ``--replicas``: a fixed address, or a name re-resolved while running."""

    host: str
    port: int
    dns: bool  # dns:///host:port (followed) rather than host:port (dialed as given)

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def __str__(self) -> str:
        return DNS_SCHEME + self.address if self.dns else self.address


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets as gRPC expects."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:  # a name, not an IP literal
        pass
    return f"{host}:{port}"


def parse_target(text: str) -> Target:
    """``host:port``, ``[v6]:port`` or ``dns:///name:port``; ``InvalidRequest`` otherwise."""
    entry = text.strip()
    dns = entry.startswith(DNS_SCHEME)
    rest = entry[len(DNS_SCHEME) :] if dns else entry
    if "://" in rest or rest.startswith("dns:"):
        raise InvalidRequest(
            f"replica address {text!r}: only host:port and dns:///NAME:PORT are supported "
            "(no DNS server authority, no other scheme)"
        )
    host, sep, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidRequest(f"replica address {text!r} is not host:port or dns:///NAME:PORT (the port is required)")
    return Target(host, int(port), dns)


def parse_targets(entries: Iterable[str]) -> list[Target]:
    """Every entry (each may itself be a comma list); ``InvalidRequest`` for a bad one or none at all."""
    targets = [parse_target(part) for entry in entries for part in entry.split(",") if part.strip()]
    if not targets:
        raise InvalidRequest("no replica address given (host:port or dns:///NAME:PORT, comma-separated)")
    return targets


def system_resolver(name: str, port: int) -> list[str]:
    """The addresses ``getaddrinfo`` gives ``name`` (TCP), sorted; [] when the name has none."""
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        if err.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []
        raise OSError(f"cannot resolve {name!r}: {err}") from None
    return sorted({format_address(info[4][0], port) for info in infos})


def hosts_file_resolver(path: str) -> Resolver:
    """Resolve names from an ``/etc/hosts``-style file (``ADDRESS NAME [NAME ...]`` a line), read at every call."""

    def resolve(name: str, port: int) -> list[str]:
        found = set()
        with open(path, encoding="utf-8") as f:
            for line in f:
                fields = line.split("#", 1)[0].split()
                if len(fields) >= 2 and name in fields[1:]:
                    found.add(format_address(fields[0], port))
        return sorted(found)

    return resolve


def default_resolver() -> Resolver:
    path = os.environ.get(HOSTS_FILE_ENV)
    return hosts_file_resolver(path) if path else system_resolver


class ReplicaDiscovery:
    """The current replica addresses of a list of targets, in the targets' order."""

    def __init__(self, targets: list[Target], resolver: Resolver | None = None) -> None:
        self.targets = list(targets)
        self._resolver = resolver or default_resolver()
        self._last: dict[Target, list[str]] = {}  # each name's last known answer

    @property
    def dynamic(self) -> bool:
        """True when some target is a name to follow (worth resolving again)."""
        return any(t.dns for t in self.targets)

    async def resolve(self) -> list[str]:
        """Every target's addresses now (duplicates dropped). A name whose lookup fails keeps its
        previous answer; a name that has no address (yet) contributes none."""
        out: list[str] = []
        for target in self.targets:
            if not target.dns:
                addresses = [target.address]
            else:
                try:  # why a thread: getaddrinfo blocks
                    addresses = await asyncio.to_thread(self._resolver, target.host, target.port)
                    self._last[target] = addresses
                except OSError as err:
                    addresses = self._last.get(target, [])
                    log.warning("resolving %s failed (%s); keeping its %d known address(es)", target, err, len(addresses))
            out.extend(a for a in addresses if a not in out)
        return out
