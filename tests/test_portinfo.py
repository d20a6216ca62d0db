"""ddprun.portinfo: listening sockets through psutil, who holds a port, whether a port is free."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import psutil
import pytest

from ddprun import portinfo
from ddprun.portinfo import ListenSocket

Addr = namedtuple("Addr", "ip port")
Conn = namedtuple("Conn", "fd family type laddr raddr status pid")  # psutil's sconn


def conn(ip, port, status, pid, *, raddr=()):
    return Conn(-1, socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, Addr(ip, port), raddr, status, pid)


CONNECTIONS = [
    conn("127.0.0.1", 8080, psutil.CONN_LISTEN, 4321),
    conn("0.0.0.0", 29500, psutil.CONN_LISTEN, None),  # another user's process, seen without root
    conn("127.0.0.1", 8080, psutil.CONN_ESTABLISHED, 4321, raddr=Addr("127.0.0.1", 41234)),
    conn("0.0.0.0", 29400, psutil.CONN_TIME_WAIT, None),
    conn("::", 29500, psutil.CONN_LISTEN, 77),
]


def test_listeners_keeps_listening_sockets_only():
    assert portinfo.listeners(CONNECTIONS) == [
        ListenSocket(addr="127.0.0.1", port=8080, pid=4321),
        ListenSocket(addr="0.0.0.0", port=29500, pid=None),
        ListenSocket(addr="::", port=29500, pid=77),
    ]
    assert portinfo.listeners([]) == []


def test_describe_holders():
    sockets = [ListenSocket("0.0.0.0", 29500, 1234), ListenSocket("::", 29500, 1234), ListenSocket("::", 8080, None)]
    names = {1234: "python3"}
    assert portinfo.describe_holders(port=29500, sockets=sockets, names=names) == "pid 1234 (python3)"
    assert portinfo.describe_holders(port=8080, sockets=sockets, names=names) == "a process this user cannot see"
    assert portinfo.describe_holders(port=9999, sockets=sockets, names=names) is None
    mixed = [ListenSocket("0.0.0.0", 29500, 7), ListenSocket("::", 29500, None)]
    assert portinfo.describe_holders(port=29500, sockets=mixed, names={7: "torchrun"}) == (
        "pid 7 (torchrun) and a process this user cannot see"
    )
    assert portinfo.describe_holders(port=29500, sockets=mixed[:1], names={}) == "pid 7 (?)"


def test_process_names_of_this_and_a_gone_process():
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    names = portinfo.process_names([os.getpid(), gone.pid])
    assert names == {os.getpid(): psutil.Process().name(), gone.pid: "?"}


def test_a_refused_listing_names_no_holder(monkeypatch):
    def refuse(kind):
        raise psutil.AccessDenied()  # macOS without root

    monkeypatch.setattr(psutil, "net_connections", refuse)
    assert portinfo.listening_sockets() == []
    assert portinfo.port_holder(29500) is None


def test_hidden_owner_is_said_to_be_hidden(monkeypatch):
    monkeypatch.setattr(psutil, "net_connections", lambda kind: CONNECTIONS)
    assert portinfo.port_holder(29500) == f"a process this user cannot see and pid 77 ({portinfo.process_names([77])[77]})"


@pytest.fixture
def listener():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def test_listening_sockets_sees_our_listener(listener):
    port = listener.getsockname()[1]
    assert ListenSocket(addr="127.0.0.1", port=port, pid=os.getpid()) in portinfo.listening_sockets()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/comm")
def test_port_holder_names_this_process(listener):
    port = listener.getsockname()[1]
    comm = Path("/proc/self/comm").read_text(encoding="utf-8").strip()  # the kernel's name, independent of psutil
    assert portinfo.port_holder(port).startswith(f"pid {os.getpid()} ({comm}")


def test_is_port_free(listener):
    port = listener.getsockname()[1]
    assert not portinfo.is_port_free(port, "127.0.0.1")
    assert not portinfo.is_port_free(port)
    listener.close()
    assert portinfo.is_port_free(port, "127.0.0.1")


def test_nothing_listens_on_a_closed_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening
    assert portinfo.port_holder(port) is None


def test_importing_portinfo_does_not_import_psutil():
    code = "import sys, ddprun.portinfo; print('psutil' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert done.stdout.strip() == "False"
