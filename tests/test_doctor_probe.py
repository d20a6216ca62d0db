"""ddprun.doctor.probe: the parsers of system files and command output, and one real gather."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from ddprun.doctor import probe

MEMINFO = """\
MemTotal:       65536000 kB
MemFree:         1000000 kB
MemAvailable:   32768000 kB
HugePages_Total:       0
"""

IP_ADDR = """\
1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
1: lo    inet6 ::1/128 scope host \\       valid_lft forever preferred_lft forever
2: eth0@if12    inet 10.1.2.3/24 brd 10.1.2.255 scope global eth0\\       valid_lft forever preferred_lft forever
2: eth0@if12    inet6 fe80::1/64 scope link \\       valid_lft forever preferred_lft forever
5: ib0    inet 192.168.10.3/16 brd 192.168.255.255 scope global ib0\\       valid_lft forever preferred_lft forever
"""

IF_INET6 = """\
fe8000000000000000fc00fffe000001 04 40 20 80     eth0
00000000000000000000000000000001 01 80 10 80       lo
"""


def test_parse_meminfo():
    assert probe.parse_meminfo(MEMINFO) == (65536000 * 1024, 32768000 * 1024)
    assert probe.parse_meminfo("") == (None, None)


def test_parse_ip_addr():
    assert probe.parse_ip_addr(IP_ADDR) == {
        "lo": ["127.0.0.1", "::1"],
        "eth0": ["10.1.2.3", "fe80::1"],
        "ib0": ["192.168.10.3"],
    }


def test_parse_if_inet6():
    assert probe.parse_if_inet6(IF_INET6) == {"eth0": ["fe80::fc:ff:fe00:1"], "lo": ["::1"]}


@pytest.mark.parametrize("number, text", [(90100, "9.1.0"), (92400, "9.24.0"), (8902, "8.9.2"), (8700, "8.7.0")])
def test_format_cudnn(number, text):
    assert probe.format_cudnn(number) == text


def test_resolve_localhost_and_a_bad_name():
    addresses, error = probe.resolve("localhost")
    assert error is None and any(a in ("127.0.0.1", "::1") for a in addresses)
    addresses, error = probe.resolve("no-such-host.invalid")
    assert addresses == () and error


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="loopback is named lo on Linux")
def test_read_interfaces_has_loopback():
    assert "127.0.0.1" in probe.read_interfaces()["lo"]


def test_probe_net_sees_a_held_port():
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        facts = probe.probe_net({"MASTER_ADDR": "localhost"}, port=port)
    assert facts.port == port and not facts.port_free
    if sys.platform.startswith("linux"):
        assert facts.port_holder == f"pid {os.getpid()} ({open('/proc/self/comm').read().strip()})"
    assert facts.master_addr_error is None and facts.master_addr_addresses


def test_probe_system_reads_this_machine():
    facts = probe.probe_system()
    assert facts.cores and facts.cores >= 1
    assert facts.python_version == ".".join(map(str, sys.version_info[:3]))
    if sys.platform.startswith("linux"):
        assert facts.mem_total and facts.shm_total
