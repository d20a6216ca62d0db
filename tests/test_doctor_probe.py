"""ddprun.doctor.probe: the parsers of system files and command output, and one real gather."""

from __future__ import annotations

import os
import socket
import sys
from collections import namedtuple
from types import SimpleNamespace

import psutil
import pytest

from ddprun.doctor import probe

Snic = namedtuple("Snic", "family address netmask broadcast ptp")  # psutil's snicaddr
PACKET = getattr(socket, "AF_PACKET", -1)

# psutil.net_if_addrs() on a container: every interface lists its AF_PACKET entry first.
IF_ADDRS = {
    "lo": [Snic(PACKET, "00:00:00:00:00:00", None, None, None), Snic(socket.AF_INET, "127.0.0.1", "255.0.0.0", None, None),
           Snic(socket.AF_INET6, "::1", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", None, None)],
    "eth0": [Snic(PACKET, "02:42:ac:11:00:02", None, "ff:ff:ff:ff:ff:ff", None),
             Snic(socket.AF_INET, "10.1.2.3", "255.255.255.0", "10.1.2.255", None),
             Snic(socket.AF_INET6, "fe80::1%eth0", "ffff:ffff:ffff:ffff::", None, None)],
    "ib0": [Snic(socket.AF_INET, "192.168.10.3", "255.255.0.0", None, None)],
    "tunl0": [Snic(PACKET, "00:00:00:00", None, None, None)],
}


def test_interface_addresses_keep_ip_addresses_in_kernel_order():
    found = probe.interface_addresses(IF_ADDRS, order=["lo", "tunl0", "eth0", "down0"])
    assert found == {
        "lo": ("127.0.0.1", "::1"),
        "tunl0": (),
        "eth0": ("10.1.2.3", "fe80::1"),
        "down0": (),  # an interface with no address at all still shows
        "ib0": ("192.168.10.3",),
    }
    assert list(found) == ["lo", "tunl0", "eth0", "down0", "ib0"]
    assert probe.interface_addresses({}, order=[]) == {}


def test_read_memory_reads_psutil(monkeypatch):
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=64 << 30, available=32 << 30, free=1))
    assert probe.read_memory() == (64 << 30, 32 << 30)


def test_read_memory_without_an_answer(monkeypatch):
    def unsupported():
        raise RuntimeError("platform not supported")

    monkeypatch.setattr(psutil, "virtual_memory", unsupported)
    assert probe.read_memory() == (None, None)


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
    assert facts.port_holder == f"pid {os.getpid()} ({psutil.Process().name()})"
    assert facts.master_addr_error is None and facts.master_addr_addresses


def test_probe_system_reads_this_machine():
    facts = probe.probe_system()
    assert facts.cores and facts.cores >= 1
    assert facts.python_version == ".".join(map(str, sys.version_info[:3]))
    assert facts.mem_total and facts.mem_available and facts.mem_available <= facts.mem_total
    if sys.platform.startswith("linux"):
        assert facts.shm_total
        meminfo = open("/proc/meminfo").read().split()
        assert facts.mem_total == int(meminfo[meminfo.index("MemTotal:") + 1]) * 1024
