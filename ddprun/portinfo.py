"""Who listens on a TCP port, as the system reports it, and whether a port is free.

Shared by the launcher ("--port 29500 is taken: held by pid 1234 (python3)") and the doctor.
This module is imported on the fast CLI path, so psutil is imported only when a holder is
asked for, which happens after a port turned out to be taken.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

_LISTEN = "LISTEN"  # psutil.CONN_LISTEN
_UNSEEN = "a process this user cannot see"


@dataclass(frozen=True)
class ListenSocket:
    """A listening TCP socket: local address ("127.0.0.1", "::"), port, and its process."""

    addr: str
    port: int
    pid: int | None  # None where the system does not say (another user's process, without root)


def listeners(connections: Iterable[Any]) -> list[ListenSocket]:
    """The LISTEN sockets among psutil.net_connections() entries (fields laddr, status, pid)."""
    found = []
    for conn in connections:
        if conn.status != _LISTEN or not conn.laddr:
            continue
        found.append(ListenSocket(addr=conn.laddr[0], port=conn.laddr[1], pid=conn.pid))
    return found


def listening_sockets() -> list[ListenSocket]:
    """Every listening TCP socket this user may list ([] where the system refuses: macOS without root)."""
    try:
        import psutil
    except ImportError:
        return []
    try:
        return listeners(psutil.net_connections(kind="tcp"))
    except (psutil.Error, OSError):
        return []


def process_names(pids: Iterable[int]) -> dict[int, str]:
    """pid -> process name ("?" where it vanished or is hidden)."""
    import psutil

    names = {}
    for pid in pids:
        try:
            names[pid] = psutil.Process(pid).name() or "?"
        except psutil.Error:
            names[pid] = "?"
    return names


def describe_holders(*, port: int, sockets: Iterable[ListenSocket], names: Mapping[int, str]) -> str | None:
    """Words for what listens on `port` ("pid 1234 (python3)"), or None when nothing does."""
    on_port = [s for s in sockets if s.port == port]
    if not on_port:
        return None
    described: list[str] = []
    for sock in on_port:
        name = _UNSEEN if sock.pid is None else f"pid {sock.pid} ({names.get(sock.pid, '?')})"
        if name not in described:
            described.append(name)
    return " and ".join(described)


def port_holder(port: int) -> str | None:
    """What listens on TCP `port` where the system says ("pid 1234 (python3)"), or None."""
    sockets = [s for s in listening_sockets() if s.port == port]
    if not sockets:
        return None
    names = process_names({s.pid for s in sockets if s.pid is not None})
    return describe_holders(port=port, sockets=sockets, names=names)


def is_port_free(port: int, host: str = "") -> bool:
    """Whether a server could bind TCP `port` on `host` ("" = every IPv4 interface) right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Servers (TCPStore included) set SO_REUSEADDR, so TIME_WAIT leftovers do not count as taken.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
