"""Listening sockets that several processes bind on one port (``SO_REUSEPORT``; no torch).

The supervisor runs the REST gateway as ``DeploymentConfig.rest_gateway_workers`` processes and the
OpenAI server as ``openai_server_workers``. Each process of a front end binds the same host and port
with ``SO_REUSEPORT``, and the kernel deals the incoming connections over their listening sockets, so
the front end's Python work spreads over as many cores. A process that dies takes only the
connections dealt to it; the others keep serving while it restarts. Both front ends listen on the
addresses waitress resolves for a host (every address of a name, IPv6 sockets IPv6 only).
"""

from __future__ import annotations

import socket


def shared_port_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound (not yet listening) TCP sockets on the addresses waitress would listen on for ``host``
    and ``port`` (its own resolution), with ``SO_REUSEPORT`` set. ``OSError`` when the port is held
    without it."""
    from waitress.adjustments import Adjustments  # why here: only the HTTP front ends' processes need it

    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, address in Adjustments(host=host, port=port).listen:
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:  # as waitress: an IPv6 socket does not also take IPv4
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets
