"""ddprun.portinfo: /proc/net/tcp parsing, who holds a port, whether a port is free."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from ddprun import portinfo
from ddprun.portinfo import ListenSocket

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# Recorded on x86_64 (little-endian): 127.0.0.1:8080 and 0.0.0.0:29500 listening,
# 127.0.0.1:8080 -> 127.0.0.1:41234 established, 0.0.0.0:29400 in TIME_WAIT.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 51234 1 0000000000000000 100 0 0 10 0
   1: 00000000:733C 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 51240 1 0000000000000000 100 0 0 10 0
   2: 0100007F:1F90 0100007F:A0D2 01 00000000:00000000 00:00000000 00000000  1000        0 51300 1 0000000000000000 20 4 30 10 -1
   3: 00000000:72D8 00000000:0000 06 00000000:00000000 03:00000A2B 00000000     0        0 0 3 0000000000000000
"""

# [::]:29500 and [::1]:6006 listening.
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:733C 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 61000 1 0000000000000000 100 0 0 10 0
   1: 00000000000000000000000001000000:1776 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 61001 1 0000000000000000 100 0 0 10 0
"""

little_endian = pytest.mark.skipif(sys.byteorder != "little", reason="the recorded text is from a little-endian host")


@little_endian
def test_parse_ipv4_listeners_only():
    assert portinfo.parse_proc_net_tcp(TCP, ipv6=False) == [
        ListenSocket(addr="127.0.0.1", port=8080, inode=51234),
        ListenSocket(addr="0.0.0.0", port=29500, inode=51240),
    ]


@little_endian
def test_parse_ipv6_listeners():
    assert portinfo.parse_proc_net_tcp(TCP6, ipv6=True) == [
        ListenSocket(addr="::", port=29500, inode=61000),
        ListenSocket(addr="::1", port=6006, inode=61001),
    ]


def test_parse_tolerates_junk():
    assert portinfo.parse_proc_net_tcp("", ipv6=False) == []
    assert portinfo.parse_proc_net_tcp("header\n  0: nonsense 0A\n  1: ZZ:ZZ 0:0 0A a b c d e f g\n", ipv6=False) == []


def test_describe_holders():
    sockets = [ListenSocket("0.0.0.0", 29500, 1), ListenSocket("::", 29500, 2), ListenSocket("::", 8080, 3)]
    owners = {1: (1234, "python3"), 2: (1234, "python3")}
    assert portinfo.describe_holders(port=29500, sockets=sockets, owners=owners) == "pid 1234 (python3)"
    assert portinfo.describe_holders(port=8080, sockets=sockets, owners=owners) == "a process this user cannot see"
    assert portinfo.describe_holders(port=9999, sockets=sockets, owners=owners) is None
    mixed = portinfo.describe_holders(port=29500, sockets=sockets, owners={1: (7, "torchrun")})
    assert mixed == "pid 7 (torchrun) and a process this user cannot see"


@pytest.fixture
def listener():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


@linux_only
def test_listening_sockets_sees_our_listener(listener):
    port = listener.getsockname()[1]
    inode = os.fstat(listener.fileno()).st_ino
    assert ListenSocket(addr="127.0.0.1", port=port, inode=inode) in portinfo.listening_sockets()


@linux_only
def test_port_holder_names_this_process(listener):
    port = listener.getsockname()[1]
    with open("/proc/self/comm", encoding="utf-8") as f:
        comm = f.read().strip()
    assert portinfo.port_holder(port) == f"pid {os.getpid()} ({comm})"


def test_is_port_free(listener):
    port = listener.getsockname()[1]
    assert not portinfo.is_port_free(port, "127.0.0.1")
    assert not portinfo.is_port_free(port)
    listener.close()
    assert portinfo.is_port_free(port, "127.0.0.1")


@linux_only
def test_nothing_listens_on_a_closed_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening
    assert portinfo.port_holder(port) is None
