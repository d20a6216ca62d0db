"""Gathering the facts the checks judge. The side effects of the doctor live here.

torch is imported inside probe_torch() only, psutil (memory, interfaces) inside the probes
that use it. What shapes a probe's raw answer is a pure function next to the probe.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ddprun import devices, portinfo
from ddprun.doctor.checks import DEFAULT_PORT, TorchGpu

RESOLVE_TIMEOUT_S = 2.0  # a broken DNS must not stall the doctor


@dataclass(frozen=True)
class SystemFacts:
    python_version: str
    executable: str
    system: str
    release: str
    machine: str
    cores: int | None
    affinity: int | None
    mem_total: int | None
    mem_available: int | None
    shm_total: int | None
    shm_free: int | None
    nofile: tuple[int | None, int | None]  # (soft, hard); None = unlimited or unknown
    memlock: tuple[int | None, int | None]
    infiniband: tuple[str, ...]


@dataclass(frozen=True)
class TorchFacts:
    version: str | None = None
    error: str | None = None
    cuda_build: str | None = None
    cudnn: str | None = None
    nccl: str | None = None
    torchvision: str | None = None
    gloo: bool = False
    nccl_available: bool = False
    mpi: bool = False
    device_count: int | None = None
    gpus: tuple[TorchGpu, ...] = ()
    arch_list: tuple[str, ...] = ()
    p2p: tuple[tuple[bool, ...], ...] | None = None


@dataclass(frozen=True)
class NetFacts:
    hostname: str
    host_addresses: tuple[str, ...]
    host_error: str | None
    interfaces: Mapping[str, tuple[str, ...]]
    master_addr_addresses: tuple[str, ...]
    master_addr_error: str | None
    port: int
    port_free: bool
    port_holder: str | None


@dataclass(frozen=True)
class Facts:
    system: SystemFacts
    torch: TorchFacts
    net: NetFacts
    inventory: tuple[devices.Gpu, ...]
    driver_version: str | None
    env: Mapping[str, str] = field(default_factory=dict)


def gather(env: Mapping[str, str]) -> Facts:
    """Every fact the checks need. Network probes run while torch imports (both take a while)."""
    net_box: list[NetFacts] = []
    worker = threading.Thread(target=lambda: net_box.append(probe_net(env)), daemon=True)
    worker.start()
    inventory = tuple(devices.read_inventory())
    driver = devices.read_driver_version()
    torch_facts = probe_torch()
    system = probe_system()
    worker.join()
    net = net_box[0] if net_box else probe_net(env)  # the thread failed: fail again here, visibly
    return Facts(system=system, torch=torch_facts, net=net, inventory=inventory, driver_version=driver, env=dict(env))


# ---------------------------------------------------------------------------------------
# System
# ---------------------------------------------------------------------------------------


def probe_system() -> SystemFacts:
    total, available = read_memory()
    shm_total, shm_free = _statvfs("/dev/shm")
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return SystemFacts(
        python_version=platform.python_version(),
        executable=sys.executable,
        system=platform.system(),
        release=platform.release(),
        machine=platform.machine(),
        cores=os.cpu_count(),
        affinity=affinity,
        mem_total=total,
        mem_available=available,
        shm_total=shm_total,
        shm_free=shm_free,
        nofile=_rlimit("RLIMIT_NOFILE"),
        memlock=_rlimit("RLIMIT_MEMLOCK"),
        infiniband=_listdir("/sys/class/infiniband"),
    )


def read_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes of RAM; (None, None) where psutil cannot tell."""
    try:
        import psutil
    except ImportError:
        return None, None
    try:
        memory = psutil.virtual_memory()
    except (psutil.Error, OSError, RuntimeError):  # RuntimeError: a platform psutil does not support
        return None, None
    return memory.total, memory.available


def _statvfs(path: str) -> tuple[int | None, int | None]:
    try:
        stat = os.statvfs(path)
    except (OSError, AttributeError):
        return None, None
    return stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize


def _rlimit(name: str) -> tuple[int | None, int | None]:
    try:
        import resource  # not on Windows
    except ImportError:
        return None, None
    try:
        soft, hard = resource.getrlimit(getattr(resource, name))
    except (AttributeError, ValueError, OSError):
        return None, None
    unlimited = resource.RLIM_INFINITY
    return (None if soft == unlimited else soft), (None if hard == unlimited else hard)


def _listdir(path: str) -> tuple[str, ...]:
    try:
        return tuple(sorted(os.listdir(path)))
    except OSError:
        return ()


# ---------------------------------------------------------------------------------------
# PyTorch
# ---------------------------------------------------------------------------------------


def probe_torch() -> TorchFacts:
    try:
        import torch
        import torch.distributed as dist
    except Exception as error:  # a broken install raises anything; report it, never crash the doctor
        return TorchFacts(error=f"{type(error).__name__}: {error}", torchvision=_package_version("torchvision"))
    available = dist.is_available()
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    return TorchFacts(
        version=torch.__version__,
        cuda_build=torch.version.cuda,
        cudnn=_cudnn_version(torch),
        nccl=_nccl_version(torch),
        torchvision=_package_version("torchvision"),
        gloo=available and dist.is_gloo_available(),
        nccl_available=available and dist.is_nccl_available(),
        mpi=available and dist.is_mpi_available(),
        device_count=count,
        gpus=tuple(_torch_gpu(torch, ordinal) for ordinal in range(count)),
        arch_list=tuple(torch.cuda.get_arch_list()) if cuda else (),
        p2p=_p2p_matrix(torch, count) if count > 1 else None,
    )


def _package_version(name: str) -> str | None:
    from importlib import metadata  # reading metadata is much faster than importing torchvision

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def format_cudnn(version: int) -> str:
    """cuDNN's integer version as text: 90100 -> "9.1.0" (cuDNN 9+), 8902 -> "8.9.2" (cuDNN 8)."""
    if version >= 90000:
        return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"


def _cudnn_version(torch) -> str | None:
    if torch.version.cuda is None:
        return None
    try:
        version = torch.backends.cudnn.version()
    except (RuntimeError, OSError):
        return None
    return format_cudnn(version) if version else None


def _nccl_version(torch) -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError, OSError):
        return None
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}" if version else None  # old torch: 2708


def _torch_gpu(torch, ordinal: int) -> TorchGpu:
    props = torch.cuda.get_device_properties(ordinal)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid and not uuid.startswith(("GPU-", "MIG-")):
        uuid = "GPU-" + uuid
    return TorchGpu(ordinal=ordinal, name=props.name, uuid=uuid, capability=(props.major, props.minor))


def _p2p_matrix(torch, count: int) -> tuple[tuple[bool, ...], ...]:
    return tuple(
        tuple(i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(count)) for i in range(count)
    )


# ---------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------


def probe_net(env: Mapping[str, str], *, port: int = DEFAULT_PORT) -> NetFacts:
    hostname = socket.gethostname()
    host_addresses, host_error = resolve(hostname)
    master = env.get("MASTER_ADDR")
    master_addresses, master_error = resolve(master) if master else ((), None)
    free = portinfo.is_port_free(port)
    return NetFacts(
        hostname=hostname,
        host_addresses=host_addresses,
        host_error=host_error,
        interfaces=read_interfaces(),
        master_addr_addresses=master_addresses,
        master_addr_error=master_error,
        port=port,
        port_free=free,
        port_holder=None if free else portinfo.port_holder(port),
    )


def resolve(host: str, *, timeout_s: float = RESOLVE_TIMEOUT_S) -> tuple[tuple[str, ...], str | None]:
    """The addresses `host` resolves to, or an error. Gives up after timeout_s (getaddrinfo cannot be cancelled)."""
    box: list[tuple[tuple[str, ...], str | None]] = []

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
            box.append((tuple(dict.fromkeys(str(info[4][0]) for info in infos)), None))
        except (OSError, UnicodeError) as error:
            box.append(((), str(error)))

    thread = threading.Thread(target=lookup, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return box[0] if box else ((), f"no answer within {timeout_s:g} s")


def read_interfaces() -> dict[str, tuple[str, ...]]:
    """Interface name -> IPv4 and IPv6 addresses, in the system's interface order."""
    try:
        import psutil

        addresses = psutil.net_if_addrs()
    except (ImportError, OSError, RuntimeError):
        addresses = {}
    return interface_addresses(addresses, order=_interface_names())


def interface_addresses(
    addresses: Mapping[str, Sequence[Any]], *, order: Sequence[str]
) -> dict[str, tuple[str, ...]]:
    """Shape psutil.net_if_addrs() (name -> entries with family and address) for the checks.

    Only IPv4 and IPv6 addresses count; a link-local IPv6 address loses its "%eth0" zone, as
    `ip addr` prints it. Interfaces come in `order` (the kernel's index order), the rest after.
    """
    found: dict[str, tuple[str, ...]] = {name: () for name in order}
    for name, entries in addresses.items():
        ips = [entry.address.split("%")[0] for entry in entries if entry.family in (socket.AF_INET, socket.AF_INET6)]
        found[name] = tuple(dict.fromkeys(ips))
    return found


def _interface_names() -> list[str]:
    try:
        return [name for _, name in sorted(socket.if_nameindex())]
    except (OSError, AttributeError):
        return []
