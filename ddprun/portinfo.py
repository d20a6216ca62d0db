"""Who listens on a TCP port, as the system reports it (Linux /proc), and whether a port is free.

Shared by the launcher ("--port 29500 is taken: held by pid 1234 (python3)") and the doctor.
Standard library only: this module is imported on the fast CLI path.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from typing import Iterable, Mapping

_TCP_LISTEN = "0A"  # st column of /proc/net/tcp: TCP_LISTEN
_PROC_NET_FILES = {"/proc/net/tcp": False, "/proc/net/tcp6": True}


@dataclass(frozen=True)
class ListenSocket:
    """A listening TCP socket: local address ("127.0.0.1", "::"), port, and the socket inode."""

    addr: str
    port: int
    inode: int


def _decode_addr(hex_addr: str, *, ipv6: bool) -> str:
    # The kernel prints each 32-bit word of the address in host byte order.
    if ipv6:
        words = [int(hex_addr[i : i + 8], 16) for i in range(0, 32, 8)]
        return socket.inet_ntop(socket.AF_INET6, struct.pack("=4I", *words))
    return socket.inet_ntop(socket.AF_INET, struct.pack("=I", int(hex_addr, 16)))


def parse_proc_net_tcp(text: str, *, ipv6: bool) -> list[ListenSocket]:
    """The LISTEN sockets in the text of /proc/net/tcp (ipv6=False) or /proc/net/tcp6 (ipv6=True)."""
    found = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != _TCP_LISTEN:
            continue
        hex_addr, _, hex_port = fields[1].partition(":")
        try:
            addr = _decode_addr(hex_addr, ipv6=ipv6)
            found.append(ListenSocket(addr=addr, port=int(hex_port, 16), inode=int(fields[9])))
        except (ValueError, struct.error, OSError):
            continue  # a line we do not understand is not worth failing over
    return found


def listening_sockets() -> list[ListenSocket]:
    """Every listening TCP socket in this network namespace ([] where /proc/net is missing)."""
    found: list[ListenSocket] = []
    for path, ipv6 in _PROC_NET_FILES.items():
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                found.extend(parse_proc_net_tcp(f.read(), ipv6=ipv6))
        except OSError:
            continue
    return found


def socket_owners(inodes: Iterable[int], *, proc: str = "/proc") -> dict[int, tuple[int, str]]:
    """Map socket inodes to (pid, command name) by reading /proc/<pid>/fd links.

    Other users' fd directories are unreadable unless we are root; their sockets stay unmapped.
    """
    wanted = {f"socket:[{inode}]": inode for inode in inodes}
    owners: dict[int, tuple[int, str]] = {}
    if not wanted:
        return owners
    try:
        pids = [name for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return owners
    for pid in pids:
        for inode in _pid_socket_inodes(f"{proc}/{pid}", wanted):
            owners.setdefault(inode, (int(pid), _comm(f"{proc}/{pid}")))
        if len(owners) == len(wanted):
            break
    return owners


def _pid_socket_inodes(pid_dir: str, wanted: Mapping[str, int]) -> list[int]:
    try:
        fds = os.listdir(f"{pid_dir}/fd")
    except OSError:
        return []
    found = []
    for fd in fds:
        try:
            target = os.readlink(f"{pid_dir}/fd/{fd}")
        except OSError:
            continue
        if target in wanted:
            found.append(wanted[target])
    return found


def _comm(pid_dir: str) -> str:
    try:
        with open(f"{pid_dir}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


def describe_holders(
    *, port: int, sockets: Iterable[ListenSocket], owners: Mapping[int, tuple[int, str]]
) -> str | None:
    """Words for what listens on `port` ("pid 1234 (python3)"), or None when nothing does."""
    on_port = [s for s in sockets if s.port == port]
    if not on_port:
        return None
    names: list[str] = []
    for sock in on_port:
        owner = owners.get(sock.inode)
        name = f"pid {owner[0]} ({owner[1]})" if owner else "a process this user cannot see"
        if name not in names:
            names.append(name)
    return " and ".join(names)


def port_holder(port: int) -> str | None:
    """What listens on TCP `port` where the system says ("pid 1234 (python3)"), or None."""
    sockets = [s for s in listening_sockets() if s.port == port]
    if not sockets:
        return None
    owners = socket_owners({s.inode for s in sockets})
    return describe_holders(port=port, sockets=sockets, owners=owners)


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
