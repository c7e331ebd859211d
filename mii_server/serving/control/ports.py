"""TCP port checks: is a port free to listen on, and which of a deployment's ports are taken."""

from __future__ import annotations

import socket

from ...errors import DeploymentStartError


def port_is_free(host: str, port: int) -> bool:
    """True if a listening socket could bind ``host:port`` now (TIME_WAIT leftovers do not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR as every server here sets it: only a live listener makes the bind fail
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError:
            return False
    return True


def ensure_free(
    ports: dict[int, str], host: str, rest_host: str | None = None, rest_port: int | None = None
) -> None:
    """Raise ``DeploymentStartError`` naming every port already taken (and what wanted it)."""
    taken = []
    for port, what in sorted(ports.items()):
        bind_host = rest_host if (rest_port is not None and port == rest_port and rest_host) else host
        if not port_is_free(bind_host, port):
            taken.append(f"{bind_host}:{port} ({what})")
    if taken:
        raise DeploymentStartError(
            f"port(s) already in use: {', '.join(taken)}; stop what holds them or choose other ports "
            "(port_number=..., restful_api_port=...)"
        )


def ensure_deployment_ports_free(addresses: dict[int, tuple[str, str]]) -> None:
    """Raise ``DeploymentStartError`` naming every taken port of ``{port: (bind host, what)}``."""
    taken = [
        f"{host}:{port} ({what})"
        for port, (host, what) in sorted(addresses.items())
        if not port_is_free(host, port)
    ]
    if taken:
        raise DeploymentStartError(
            f"port(s) already in use: {', '.join(taken)}; stop what holds them or choose other ports "
            "(port_number=..., restful_api_port=..., openai_api_port=..., metrics_port=...)"
        )
