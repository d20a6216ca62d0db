"""The doctor's checks: one pure function per check, facts in, a CheckResult out.

Nothing here reads the machine or imports torch; probe.py gathers the facts and main.py
feeds them in, so every rule is tested directly on broken environments.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from ddprun import devices
from ddprun.errors import UsageError

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
STATUSES = (OK, WARN, FAIL, SKIP)
GIB = 1 << 30
MIN_SHM_BYTES = GIB
MIN_OPEN_FILES = 4096
DEFAULT_PORT = 29500
EXIT_STEP = "exit"  # the smoke worker's last mark, after destroy_process_group returned
TORCH_INDEX = "https://download.pytorch.org/whl"
ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDA_", "MASTER_", "PET_", "GLOO_")
ENV_NAMES = ("OMP_NUM_THREADS",)
# Lowest Linux driver for each CUDA major version (minor versions run on it by compatibility).
MIN_DRIVER_FOR_CUDA = {11: (450, 80), 12: (525, 60), 13: (580, 65)}

NCCL_ERROR_HINT = (
    "Check the backend and the devices: NCCL needs one distinct GPU per rank. Run one rank per GPU "
    "(--gpus all, or --nproc equal to the GPUs CUDA_VISIBLE_DEVICES exposes), call "
    "torch.cuda.set_device(local_rank) before init_process_group, or try --cpu (gloo) to rule NCCL out. "
    "NCCL_DEBUG=INFO shows NCCL's own reason."
)
PORT_HINT = (
    "ddprun picks a free loopback port by itself for single-node jobs. For multi-node jobs or plain "
    "torchrun, choose another port: ddprun run --port 29501 (torchrun --master-port 29501)."
)
SHM_HINT = (
    "In a container, give it more shared memory: docker run --shm-size=8g (or --ipc=host); "
    "on Kubernetes mount an emptyDir with medium: Memory at /dev/shm."
)
DESTROY_HINT = (
    "End every training script with torch.distributed.destroy_process_group() (in a finally block); "
    "without it ranks can hang at exit or warn 'process group has NOT been destroyed'."
)


@dataclass(frozen=True)
class CheckResult:
    """One line of the doctor's report. status is "ok", "warn", "fail" or "skip"."""

    name: str
    status: str
    detail: str
    hint: str | None = None


# ---------------------------------------------------------------------------------------
# Small pure helpers
# ---------------------------------------------------------------------------------------

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from a human size: "1024", "64K", "64M", "1G", "1.5GiB", "64MB" (binary units)."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise UsageError(f'"{text}" is not a size: write bytes or a number with K, M or G, e.g. 64M or 1G')
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size < 8:
        raise UsageError(f'size "{text}" is under 8 bytes: the sweep starts at 8 bytes, e.g. use 64M')
    return size


def human_bytes(size: float) -> str:
    """1536 -> "1.5 KiB"; exact powers print without decimals ("64 MiB")."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if size == int(size) else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def parse_version(text: str | None) -> tuple[int, ...]:
    """"550.54.15" -> (550, 54, 15); missing or odd parts count as 0."""
    numbers = re.findall(r"[0-9]+", text or "")
    return tuple(int(n) for n in numbers) or (0,)


def cuda_wheel_tag(driver_version: str | None) -> str | None:
    """The PyTorch wheel index that suits this driver ("cu130", "cu126"), None if the driver is too old."""
    major = parse_version(driver_version)[0]
    if major >= MIN_DRIVER_FOR_CUDA[13][0]:
        return "cu130"
    if major >= MIN_DRIVER_FOR_CUDA[12][0]:
        return "cu126"
    return None


def pip_command(driver_version: str | None) -> str:
    """The pip line that installs torch for this driver (cu126 where the driver is older than any wheel)."""
    tag = cuda_wheel_tag(driver_version) or "cu126"
    return f"pip install --force-reinstall torch torchvision --index-url {TORCH_INDEX}/{tag}"


def install_hint(driver_version: str | None) -> str:
    """What to type to get a torch that uses this driver."""
    if cuda_wheel_tag(driver_version) is None:
        return (
            f"Driver {driver_version} is too old for current PyTorch wheels: upgrade the NVIDIA driver "
            f"(>= {MIN_DRIVER_FOR_CUDA[12][0]}), then {pip_command(None)}"
        )
    return f"Install a torch build for this driver: {pip_command(driver_version)}"


def driver_supports(*, driver_version: str, cuda_build: str) -> bool:
    """Whether a Linux driver runs a torch built for `cuda_build` ("12.4")."""
    needed = MIN_DRIVER_FOR_CUDA.get(parse_version(cuda_build)[0])
    return needed is None or parse_version(driver_version)[:2] >= needed


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _unlimited(value: int | None) -> bool:
    return value is None or value < 0  # resource.RLIM_INFINITY is -1 on Linux


def _limit_text(value: int | None, *, in_bytes: bool = False) -> str:
    if _unlimited(value):
        return "unlimited"
    return human_bytes(value) if in_bytes else str(value)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------------------------------
# System
# ---------------------------------------------------------------------------------------


def check_python(*, version: str, executable: str) -> CheckResult:
    return CheckResult("python", OK, f"Python {version} ({executable})")


def check_os(*, system: str, release: str, machine: str) -> CheckResult:
    detail = f"{system} {release} ({machine})"
    if system != "Linux":
        return CheckResult(
            "os", WARN, detail + ": NCCL runs on Linux only", hint="Use the gloo backend (ddprun run --cpu) here."
        )
    return CheckResult("os", OK, detail)


def check_cpu(*, cores: int | None, affinity: int | None) -> CheckResult:
    if not cores:
        return CheckResult("cpu", SKIP, "core count unknown")
    detail = f"{cores} cores"
    if affinity and affinity != cores:
        detail += f", {affinity} usable by this process"
    return CheckResult("cpu", OK, detail)


def check_memory(*, total_bytes: int | None, available_bytes: int | None) -> CheckResult:
    if total_bytes is None:
        return CheckResult("memory", SKIP, "could not read the memory size")
    detail = f"{human_bytes(total_bytes)} total"
    if available_bytes is None:
        return CheckResult("memory", OK, detail)
    detail += f", {human_bytes(available_bytes)} available"
    if available_bytes < GIB:
        hint = "Every rank loads its own copy of the model and data; free memory or run fewer ranks (--nproc)."
        return CheckResult("memory", WARN, detail, hint=hint)
    return CheckResult("memory", OK, detail)


def check_shm(*, total_bytes: int | None, free_bytes: int | None) -> CheckResult:
    """DataLoader workers, NCCL's intra-node transport and `ddprun train`'s CPU all-reduce live in /dev/shm;
    64 MiB (Docker's default) breaks the first two and sends the third back to gloo."""
    if total_bytes is None:
        return CheckResult("/dev/shm", SKIP, "no /dev/shm on this system")
    free = free_bytes if free_bytes is not None else total_bytes
    detail = f"{human_bytes(total_bytes)} total, {human_bytes(free)} free"
    if total_bytes < MIN_SHM_BYTES or free < MIN_SHM_BYTES:
        detail += (f": under {human_bytes(MIN_SHM_BYTES)}; DataLoader workers and NCCL may die with 'Bus error', "
                   f"and ddprun train averages CPU gradients through gloo instead")
        return CheckResult("/dev/shm", WARN, detail, hint=SHM_HINT)
    return CheckResult("/dev/shm", OK, detail)


def check_open_files(*, soft: int | None, hard: int | None) -> CheckResult:
    detail = f"soft {_limit_text(soft)}, hard {_limit_text(hard)}"
    if _unlimited(soft) or soft >= MIN_OPEN_FILES:
        return CheckResult("open files limit", OK, detail)
    raise_to = "65536" if _unlimited(hard) or hard >= 65536 else str(hard)
    hint = (
        f"DataLoader workers share tensors through file descriptors ('Too many open files'): "
        f"run `ulimit -n {raise_to}` before launching"
    )
    if not _unlimited(hard) and hard < MIN_OPEN_FILES:
        hint += "; raise the hard limit in /etc/security/limits.conf or docker run --ulimit nofile=65536:65536"
    return CheckResult("open files limit", WARN, detail + f": under {MIN_OPEN_FILES}", hint=hint + ".")


def check_memlock(*, soft: int | None, hard: int | None, infiniband_devices: Sequence[str]) -> CheckResult:
    """InfiniBand (RDMA) pins memory; a small locked-memory limit makes NCCL fail to register buffers."""
    detail = f"soft {_limit_text(soft, in_bytes=True)}, hard {_limit_text(hard, in_bytes=True)}"
    if _unlimited(soft):
        return CheckResult("locked memory limit", OK, detail)
    if not infiniband_devices:
        return CheckResult("locked memory limit", OK, detail + " (matters for InfiniBand only; none found)")
    hint = "Run `ulimit -l unlimited` before launching (docker run --ulimit memlock=-1:-1; limits.conf: memlock unlimited)."
    detail += f" with InfiniBand devices {', '.join(infiniband_devices)}: NCCL cannot pin its buffers"
    return CheckResult("locked memory limit", WARN, detail, hint=hint)


# ---------------------------------------------------------------------------------------
# PyTorch
# ---------------------------------------------------------------------------------------


def check_torch(
    *, version: str | None, cuda_build: str | None, cudnn: str | None, nccl: str | None, error: str | None
) -> CheckResult:
    if version is None:
        hint = f"pip install torch torchvision (CUDA builds: --index-url {TORCH_INDEX}/cu126)"
        return CheckResult("torch", FAIL, f"cannot import torch: {error or 'not installed'}", hint=hint)
    parts = [f"CUDA {cuda_build}" if cuda_build else "CPU-only build"]
    if cudnn:
        parts.append(f"cuDNN {cudnn}")
    if nccl:
        parts.append(f"NCCL {nccl}")
    return CheckResult("torch", OK, f"torch {version} ({', '.join(parts)})")


def check_torchvision(*, version: str | None, torch_version: str | None) -> CheckResult:
    if version is None:
        return CheckResult(
            "torchvision", WARN, "not installed; `ddprun train` needs it", hint="pip install torchvision"
        )
    expected = _torchvision_for(torch_version)
    if expected and parse_version(version)[:2] != expected:
        pair = f"{expected[0]}.{expected[1]}"
        detail = f"torchvision {version} does not match torch {torch_version} (expects torchvision {pair}.x)"
        hint = f"Mismatched pairs fail with 'operator torchvision::nms does not exist': pip install torchvision=={pair}.*"
        return CheckResult("torchvision", WARN, detail, hint=hint)
    return CheckResult("torchvision", OK, f"torchvision {version}")


def _torchvision_for(torch_version: str | None) -> tuple[int, int] | None:
    # torch 2.N pairs with torchvision 0.(N+15) since torch 2.0 / torchvision 0.15.
    numbers = parse_version(torch_version)
    if torch_version is None or numbers[0] != 2 or len(numbers) < 2:
        return None
    return (0, numbers[1] + 15)


def check_backends(*, gloo: bool, nccl: bool, mpi: bool, gpus_usable: bool) -> CheckResult:
    names = [name for name, there in (("gloo", gloo), ("nccl", nccl), ("mpi", mpi)) if there]
    detail = "available: " + (", ".join(names) if names else "none")
    if not gloo and not nccl:
        hint = "This torch was built without torch.distributed; install the official wheel from pytorch.org."
        return CheckResult("distributed backends", FAIL, detail, hint=hint)
    if gpus_usable and not nccl:
        hint = f"Install an official CUDA build: pip install torch --index-url {TORCH_INDEX}/cu126"
        return CheckResult("distributed backends", WARN, detail + "; GPUs without nccl run slowly on gloo", hint=hint)
    return CheckResult("distributed backends", OK, detail)


def check_torch_cuda_build(*, cuda_build: str | None, driver_version: str | None) -> CheckResult:
    """A CPU-only wheel, or a CUDA build newer than the driver, cannot use the GPUs."""
    name = "torch CUDA build"
    if driver_version is None:
        what = f"built for CUDA {cuda_build}" if cuda_build else "CPU-only build"
        return CheckResult(name, OK, f"{what}; no NVIDIA driver on this machine, so CPU and gloo only")
    if cuda_build is None:
        detail = f"CPU-only torch on a machine with NVIDIA driver {driver_version}: the GPUs go unused"
        return CheckResult(name, FAIL, detail, hint=install_hint(driver_version))
    if not driver_supports(driver_version=driver_version, cuda_build=cuda_build):
        needed = ".".join(str(n) for n in MIN_DRIVER_FOR_CUDA[parse_version(cuda_build)[0]])
        detail = f"torch built for CUDA {cuda_build} needs driver >= {needed}; this one is {driver_version}"
        hint = f"Upgrade the NVIDIA driver to >= {needed}, or install a torch build for this driver: "
        return CheckResult(name, FAIL, detail, hint=hint + pip_command(driver_version))
    return CheckResult(name, OK, f"CUDA {cuda_build}, supported by driver {driver_version}")


# ---------------------------------------------------------------------------------------
# GPUs
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TorchGpu:
    """A device as torch numbers it (cuda:<ordinal>), from torch.cuda.get_device_properties."""

    ordinal: int
    name: str
    uuid: str  # "GPU-…", "" when torch does not report it
    capability: tuple[int, int]


def check_driver(*, driver_version: str | None, gpu_count: int) -> CheckResult:
    if driver_version is None and gpu_count == 0:
        return CheckResult("NVIDIA driver", SKIP, "no NVIDIA driver or GPU found (CPU-only machine)")
    plural = "GPU" if gpu_count == 1 else "GPUs"
    return CheckResult("NVIDIA driver", OK, f"driver {driver_version or 'version unknown'}, {gpu_count} {plural}")


def check_visible_devices(*, value: str | None, inventory: Sequence[devices.Gpu]) -> CheckResult:
    """CUDA_VISIBLE_DEVICES read by the launcher's own validator."""
    name = "CUDA_VISIBLE_DEVICES"
    shown = "unset" if value is None else f'"{value}"'
    try:
        visible = devices.visible_gpus(value, inventory)
    except UsageError as error:
        return CheckResult(name, FAIL if inventory else WARN, error.message, hint=error.hint)
    if not inventory:
        return CheckResult(name, SKIP, f"{shown}; no GPU to expose")
    if not visible:
        hint = "Unset it (or list the GPUs to use) to train on GPUs."
        return CheckResult(name, WARN, f"{shown}: hides every GPU, jobs run on CPU", hint=hint)
    listing = ", ".join(devices.describe_gpu(v, ordinal=i) for i, v in enumerate(visible))
    return CheckResult(name, OK, f"{shown}: {listing}")


def check_gpu(
    *, ordinal: int, visible: devices.VisibleGpu, torch_gpu: TorchGpu | None, arch_list: Sequence[str]
) -> CheckResult:
    """One visible device: index, UUID, name, memory and (from torch) its compute capability."""
    gpu = visible.gpu
    name = f"cuda:{ordinal}"
    parts = [devices.describe_gpu(visible)] + ([gpu.uuid] if gpu else [])
    if torch_gpu is None:
        return CheckResult(name, OK, ", ".join(parts + ["compute capability unknown (torch sees no GPU)"]))
    major, minor = torch_gpu.capability
    parts.append(f"compute capability {major}.{minor}")
    detail = ", ".join(parts)
    if not arch_supported(torch_gpu.capability, arch_list):
        hint = f"torch ships kernels for {', '.join(arch_list)} only: install a newer torch build for sm_{major}{minor}."
        return CheckResult(name, FAIL, detail + ": this torch has no kernels for it", hint=hint)
    return CheckResult(name, OK, detail)


def arch_supported(capability: tuple[int, int], arch_list: Sequence[str]) -> bool:
    """Whether torch's compiled architectures (torch.cuda.get_arch_list()) run on this capability."""
    major, minor = capability
    known = False
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        digits = re.match(r"[0-9]+", number)
        if kind not in ("sm", "compute") or not digits:
            continue
        known = True
        arch_major, arch_minor = divmod(int(digits.group(0)), 10)
        if kind == "sm" and arch_major == major and arch_minor <= minor:
            return True  # binaries run on later minor revisions of the same major
        if kind == "compute" and (arch_major, arch_minor) <= (major, minor):
            return True  # PTX is compiled for newer GPUs at load time
    return not known  # an empty or unfamiliar list: say nothing rather than guess


def check_device_count(
    *, torch_count: int | None, visible_count: int | None, cuda_build: str | None, driver_version: str | None
) -> CheckResult:
    """torch.cuda.device_count() against what the driver reports as visible."""
    name = "torch sees the GPUs"
    if torch_count is None or visible_count is None:
        why = "torch is missing" if torch_count is None else "CUDA_VISIBLE_DEVICES is invalid"
        return CheckResult(name, SKIP, f"not compared: {why}")
    if torch_count == visible_count == 0:
        return CheckResult(name, SKIP, "no visible GPU")
    detail = f"torch.cuda.device_count() = {torch_count}, the driver shows {visible_count} visible"
    if torch_count == visible_count:
        return CheckResult(name, OK, detail)
    if torch_count == 0:
        too_old = driver_version and not driver_supports(driver_version=driver_version, cuda_build=cuda_build or "")
        if cuda_build is None or too_old:
            return CheckResult(name, FAIL, detail, hint=install_hint(driver_version))
        hint = (
            "torch cannot initialise CUDA: `python -c 'import torch; torch.cuda.init()'` prints why. "
            "In a container, start it with --gpus all (NVIDIA Container Toolkit)."
        )
        return CheckResult(name, FAIL, detail, hint=hint)
    hint = "Compare `nvidia-smi -L` with CUDA_VISIBLE_DEVICES: CUDA drops every entry after one it cannot use."
    return CheckResult(name, WARN, detail, hint=hint)


def check_p2p(*, matrix: Sequence[Sequence[bool]] | None, visible_count: int | None) -> CheckResult:
    """Peer-to-peer access between visible GPUs (torch.cuda.can_device_access_peer)."""
    name = "GPU peer-to-peer"
    if matrix is None or len(matrix) < 2:
        if (visible_count or 0) >= 2:
            return CheckResult(name, SKIP, f"not measured: torch cannot use the {visible_count} visible GPUs")
        return CheckResult(name, SKIP, "fewer than 2 visible GPUs")
    n = len(matrix)
    missing = [f"{i}<->{j}" for i in range(n) for j in range(i + 1, n) if not (matrix[i][j] and matrix[j][i])]
    if not missing:
        return CheckResult(name, OK, f"every pair of the {n} GPUs has P2P access")
    hint = (
        "NCCL copies through host memory between these GPUs (correct, slower); `nvidia-smi topo -m` shows the path. "
        "If NCCL hangs here, NCCL_P2P_DISABLE=1 is the usual workaround."
    )
    return CheckResult(name, WARN, "no P2P access between cuda:" + ", ".join(missing), hint=hint)


# ---------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------


def check_hostname(
    *, hostname: str, addresses: Sequence[str], error: str | None, interfaces: Mapping[str, Sequence[str]]
) -> CheckResult:
    """Other nodes reach this one by name in multi-node jobs; a loopback answer sends them to themselves."""
    name = "hostname"
    routable = _routable_addresses(interfaces)
    use = f"map {hostname} to {routable[0]} in /etc/hosts" if routable else f"map {hostname} to this node's IP in /etc/hosts"
    if error is not None or not addresses:
        detail = f"{hostname} does not resolve ({error or 'no address'})"
        hint = f"Single-node jobs do not care. For multi-node jobs, {use} or give the master address as an IP."
        return CheckResult(name, WARN, detail, hint=hint)
    detail = f"{hostname} -> {', '.join(addresses)}"
    if all(is_loopback(address) for address in addresses):
        hint = (
            f"Fine for single-node jobs. For multi-node jobs other nodes cannot reach this one by name: "
            f"{use}, or give the master address as an IP."
        )
        return CheckResult(name, WARN, detail + " (loopback only)", hint=hint)
    return CheckResult(name, OK, detail)


def _routable_addresses(interfaces: Mapping[str, Sequence[str]]) -> list[str]:
    found = []
    for addresses in interfaces.values():
        for address in addresses:
            try:
                ip = ipaddress.ip_address(address.split("%")[0])
            except ValueError:
                continue
            if not (ip.is_loopback or ip.is_link_local):
                found.append(str(ip))
    return sorted(found, key=lambda a: ":" in a)  # IPv4 first


def check_interfaces(*, interfaces: Mapping[str, Sequence[str]]) -> CheckResult:
    name = "network interfaces"
    if not interfaces:
        return CheckResult(name, SKIP, "could not list the network interfaces")
    detail = "; ".join(f"{ifname} {', '.join(addrs) or '(no address)'}" for ifname, addrs in interfaces.items())
    if not _routable_addresses(interfaces):
        hint = "Multi-node jobs need an interface other nodes can reach; single-node jobs are fine."
        return CheckResult(name, WARN, detail + " (loopback or link-local only)", hint=hint)
    return CheckResult(name, OK, detail)


def select_interfaces(spec: str, names: Sequence[str], *, nccl_syntax: bool = True) -> list[str]:
    """The interfaces a *_SOCKET_IFNAME value selects.

    NCCL: a comma list of prefixes ("eth" matches eth0); "=" in front makes them exact names;
    "^" in front excludes the listed ones instead ("^docker,lo"; "^=eth0" exact exclusion).
    Gloo: a comma list of exact names.
    """
    exclude = exact = False
    if nccl_syntax:
        exclude = spec.startswith("^")
        spec = spec[1:] if exclude else spec
        exact = spec.startswith("=")
        spec = spec[1:] if exact else spec
    entries = [entry.strip() for entry in spec.split(",") if entry.strip()]
    if not nccl_syntax:
        return [entry for entry in entries if entry in names]

    def listed(name: str) -> bool:
        return any(name == entry if exact else name.startswith(entry) for entry in entries)

    return [name for name in names if listed(name) != exclude]


def check_socket_ifname(*, variable: str, value: str | None, interfaces: Mapping[str, Sequence[str]]) -> CheckResult:
    """NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME must select interfaces that exist (interfaces: name -> addresses)."""
    nccl = variable.startswith("NCCL")
    suggestion = _suggest(interfaces)
    if value is None:
        return CheckResult(variable, OK, f"unset: {'NCCL' if nccl else 'gloo'} picks an interface itself")
    have = ", ".join(interfaces) or "none"
    if not interfaces:
        return CheckResult(variable, SKIP, f"{variable}={value}; could not list the interfaces to check it")
    selected = select_interfaces(value, list(interfaces), nccl_syntax=nccl)
    wanted = [entry.strip() for entry in value.split(",") if entry.strip()]
    missing = [] if nccl else [entry for entry in wanted if entry not in interfaces]
    if selected and not missing:
        return CheckResult(variable, OK, f"{variable}={value} selects {', '.join(selected)}")
    if nccl:
        detail = f"{variable}={value} matches no interface (this machine has: {have})"
        hint = (
            f"Set it to an interface that exists, e.g. {variable}={suggestion}, or unset it. "
            "NCCL takes prefixes ('eth' matches eth0), '=' for exact names, '^' to exclude ('^lo,docker')."
        )
    else:
        detail = f"{variable}={value} names {', '.join(missing or wanted)}, not an interface here (this machine has: {have})"
        hint = f"Gloo takes exact interface names, comma-separated: e.g. {variable}={suggestion}, or unset it."
    return CheckResult(variable, FAIL, detail, hint=hint)


def _suggest(interfaces: Mapping[str, Sequence[str]]) -> str:
    """An interface worth naming: one with a routable address, else any but loopback."""
    routable = [name for name, addresses in interfaces.items() if _routable_addresses({name: addresses})]
    others = [name for name in interfaces if name != "lo"]
    return (routable or others or list(interfaces) or ["eth0"])[0]


def check_master_addr(*, value: str | None, addresses: Sequence[str], error: str | None) -> CheckResult:
    if value is None:
        return CheckResult("MASTER_ADDR", OK, "unset (ddprun uses loopback for single-node jobs)")
    if error is not None or not addresses:
        detail = f"MASTER_ADDR={value} does not resolve ({error or 'no address'})"
        hint = "Set MASTER_ADDR to the IP or resolvable name of the node running rank 0, or unset it for single-node jobs."
        return CheckResult("MASTER_ADDR", FAIL, detail, hint=hint)
    return CheckResult("MASTER_ADDR", OK, f"MASTER_ADDR={value} -> {', '.join(addresses)}")


def check_port(*, port: int, free: bool, holder: str | None) -> CheckResult:
    name = f"port {port}"
    if free:
        return CheckResult(name, OK, "free")
    who = holder or "a process the system does not name"
    return CheckResult(name, WARN, f"in use by {who} (torchrun's default rendezvous port)", hint=PORT_HINT)


# ---------------------------------------------------------------------------------------
# Environment variables
# ---------------------------------------------------------------------------------------

# torch's old names for its own NCCL settings; torch reads them with a deprecation warning.
_DEPRECATED_NCCL = ("NCCL_ASYNC_ERROR_HANDLING", "NCCL_BLOCKING_WAIT", "NCCL_DESYNC_DEBUG")


def relevant_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables that change how distributed jobs run, sorted by name."""
    return {k: env[k] for k in sorted(env) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def check_env_listing(*, env: Mapping[str, str]) -> CheckResult:
    found = relevant_env(env)
    if not found:
        return CheckResult("environment", OK, "no NCCL_*, TORCH_*, CUDA_*, OMP_NUM_THREADS, MASTER_*, PET_* set")
    shown = ", ".join(f"{k}={v if len(v) <= 60 else v[:57] + '...'}" for k, v in found.items())
    return CheckResult("environment", OK, shown)


def check_env_combinations(
    *, env: Mapping[str, str], p2p_works: bool | None, infiniband_devices: Sequence[str], cores: int | None
) -> list[CheckResult]:
    """Known-bad settings; one warn (or fail) per problem, nothing when all is well."""
    found: list[CheckResult] = []
    if _truthy(env.get("NCCL_P2P_DISABLE")) and p2p_works:
        hint = "Unset NCCL_P2P_DISABLE unless it works around a hang seen on this machine: GPU traffic then goes through host memory."
        found.append(CheckResult("NCCL_P2P_DISABLE", WARN, "set to 1, but P2P works between all visible GPUs", hint=hint))
    if _truthy(env.get("NCCL_IB_DISABLE")) and infiniband_devices:
        hint = "Unset NCCL_IB_DISABLE: multi-node traffic falls back to TCP sockets, often 10x slower."
        detail = f"set to 1, but InfiniBand devices exist ({', '.join(infiniband_devices)})"
        found.append(CheckResult("NCCL_IB_DISABLE", WARN, detail, hint=hint))
    if _truthy(env.get("NCCL_SHM_DISABLE")):
        hint = "Unset it; if it works around a small /dev/shm, grow /dev/shm instead. " + SHM_HINT
        found.append(CheckResult("NCCL_SHM_DISABLE", WARN, "set to 1: GPUs without P2P talk through sockets", hint=hint))
    for old in _DEPRECATED_NCCL:
        if old in env:
            hint = f"Rename it to TORCH_{old}; torch reads the old name only with a deprecation warning."
            found.append(CheckResult(old, WARN, f"{old}={env[old]} is a deprecated name", hint=hint))
    if _truthy(env.get("CUDA_LAUNCH_BLOCKING")):
        hint = "Unset it after debugging: it serialises every CUDA kernel launch."
        found.append(CheckResult("CUDA_LAUNCH_BLOCKING", WARN, "set to 1: training runs much slower", hint=hint))
    if env.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        hint = "Unset it (or use INFO) once mismatched collectives are found: DETAIL checks every collective."
        found.append(CheckResult("TORCH_DISTRIBUTED_DEBUG", WARN, "DETAIL slows every collective", hint=hint))
    found.extend(_check_omp(env.get("OMP_NUM_THREADS"), cores=cores))
    found.extend(_check_master_port(env.get("MASTER_PORT")))
    return found


def _check_omp(value: str | None, *, cores: int | None) -> list[CheckResult]:
    if value is None:
        return []
    if not value.strip().isdigit() or int(value) < 1:
        hint = "Set OMP_NUM_THREADS to a positive integer, e.g. cores divided by ranks, or unset it."
        return [CheckResult("OMP_NUM_THREADS", WARN, f'"{value}" is not a positive integer', hint=hint)]
    if cores and int(value) > cores:
        hint = f"Every rank starts that many threads: use at most {cores} divided by the ranks per node."
        return [CheckResult("OMP_NUM_THREADS", WARN, f"{value} threads per rank on {cores} cores", hint=hint)]
    return []


def _check_master_port(value: str | None) -> list[CheckResult]:
    if value is None:
        return []
    if value.strip().isdigit() and 0 < int(value) < 65536:
        return []
    hint = "Set MASTER_PORT to a free port number (1-65535), e.g. 29501, or unset it."
    return [CheckResult("MASTER_PORT", FAIL, f'"{value}" is not a port number', hint=hint)]


# ---------------------------------------------------------------------------------------
# Live smoke test
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """What one rank was doing, as the smoke worker records it before each step."""

    rank: int
    pid: int
    index: int  # position of the step in the worker's sequence
    step: str


def format_progress(*, pid: int, index: int, step: str) -> str:
    return f"{pid} {index} {step}\n"


def rank_report_path(out: str, rank: int) -> str:
    """Where a smoke rank other than 0 writes its results, once one of its steps failed."""
    return f"{out}.rank{rank}"


def with_other_ranks_failure(report: Mapping | None, others: Mapping[int, Mapping]) -> Mapping | None:
    """Rank 0's report, plus the first failure another rank recorded where rank 0's shows none:
    the launcher stops every rank once one fails, so rank 0 may be gone before it could report."""
    if report is not None and any(step.get("status") == FAIL for step in report.get("steps", [])):
        return report
    for rank in sorted(others):
        failed = next((step for step in others[rank].get("steps", []) if step.get("status") == FAIL), None)
        if failed is not None:
            base = report if report is not None else {k: v for k, v in others[rank].items() if k != "steps"}
            step = {**failed, "detail": f"rank {rank}: {failed.get('detail', '')}"}
            return {**base, "steps": [*base.get("steps", []), step]}
    return report


def parse_progress(rank: int, text: str) -> Progress | None:
    pid, _, rest = text.strip().partition(" ")
    index, _, step = rest.partition(" ")
    if not (pid.isdigit() and index.isdigit() and step):
        return None
    return Progress(rank=rank, pid=int(pid), index=int(index), step=step)


def describe_hang(progress: Sequence[Progress], *, nranks: int) -> tuple[str | None, str]:
    """(the step that hung, words for where every rank was). The hung step is the least advanced one."""
    seen = {p.rank for p in progress}
    missing = [rank for rank in range(nranks) if rank not in seen]
    if not progress:
        return None, f"no rank had started (of {nranks})"
    slowest = min(progress, key=lambda p: p.index)
    steps: dict[str, list[int]] = {}
    for p in sorted(progress, key=lambda p: p.rank):
        steps.setdefault(p.step, []).append(p.rank)
    where = [f"{step} (rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))})" for step, ranks in steps.items()]
    if missing:
        where.append(f"not started (rank{'s' if len(missing) > 1 else ''} {','.join(map(str, missing))})")
    return (None if missing else slowest.step), "; ".join(where)


def hang_hint(step: str | None, *, backend: str) -> str:
    if step is None:
        return (
            "The ranks did not all start in time: on a slow or busy machine rerun with a longer --timeout; "
            "otherwise run `ddprun run --nproc 2 --cpu -m ddprun.doctor.smoke` to watch their output."
        )
    if step == "init_process_group":
        hint = (
            "The ranks could not meet: check that the master address and port are reachable (firewall), that "
            "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name a working interface, and that all ranks use the same backend."
        )
        return hint + (" " + NCCL_ERROR_HINT if backend == "nccl" else "")
    if step == "destroy_process_group":
        return "Shutdown hung: a rank still had collectives in flight. " + DESTROY_HINT
    if step == EXIT_STEP:
        return (
            "Every step finished but the ranks did not exit in time: on a slow or busy machine rerun with a "
            "longer --timeout; otherwise a process left behind by another job may be holding them."
        )
    if backend == "nccl":
        return (
            "A GPU collective hung: rerun with NCCL_DEBUG=INFO. NCCL_P2P_DISABLE=1 works around broken P2P "
            "(IOMMU/ACS in VMs), NCCL_SHM_DISABLE=1 a too-small /dev/shm. " + NCCL_ERROR_HINT
        )
    return "A collective hung: check GLOO_SOCKET_IFNAME and any firewall between the ranks."


def failure_hint(text: str, *, backend: str) -> str:
    """The hint for an error message or output tail, by what it mentions."""
    lowered = text.lower()
    if "address already in use" in lowered or "eaddrinuse" in lowered:
        return PORT_HINT
    if "process group has not been destroyed" in lowered or "destroy_process_group" in lowered:
        return DESTROY_HINT
    if "bus error" in lowered or "/dev/shm" in lowered or "no space left on device" in lowered:
        return SHM_HINT
    if "nccl" in lowered or "cuda" in lowered or backend == "nccl":
        return NCCL_ERROR_HINT
    return "Rerun the smoke test by hand to see every rank's output: ddprun run --nproc 2 --cpu -m ddprun.doctor.smoke"


def check_smoke(
    *,
    report: Mapping | None,
    returncode: int | None,
    timed_out: bool,
    timeout_s: float,
    progress: Sequence[Progress],
    output_tail: str,
    backend: str,
    nranks: int,
) -> list[CheckResult]:
    """The smoke test's own step results plus one fail for a hang, a crash or a missing report."""
    results = [_smoke_step(step, backend=backend, output_tail=output_tail) for step in (report or {}).get("steps", [])]
    what = f"{nranks} ranks on {backend}"
    if timed_out:
        step, where = describe_hang(progress, nranks=nranks)
        detail = f"{what}: no end within {timeout_s:g} s, stopped. Hung in {step or 'start-up'}; ranks were at: {where}"
        return results + [CheckResult("smoke test", FAIL, detail, hint=hang_hint(step, backend=backend))]
    if report is None or returncode != 0:
        last = _last_lines(output_tail)
        detail = f"{what}: exited with code {returncode}" + (" before reporting" if report is None else "")
        detail += f": {last}" if last else ""
        return results + [CheckResult("smoke test", FAIL, detail, hint=failure_hint(output_tail, backend=backend))]
    failed = [r for r in results if r.status == FAIL]
    if not failed:
        results.insert(0, CheckResult("smoke test", OK, f"{what}: {report.get('device', 'cpu')}, every check passed"))
    return results


def _smoke_step(step: Mapping, *, backend: str, output_tail: str) -> CheckResult:
    name, status, detail = str(step.get("name")), str(step.get("status")), str(step.get("detail", ""))
    status = status if status in STATUSES else FAIL
    hint = None
    if status == FAIL:
        hint = DESTROY_HINT if name == "destroy_process_group" else failure_hint(detail + output_tail, backend=backend)
    elif name == "destroy_process_group":
        detail += "; end your own scripts with destroy_process_group() too, in a finally block"
    return CheckResult(f"smoke: {name}", status, detail, hint=hint)


def _last_lines(text: str, count: int = 3) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-count:])


def check_bandwidth(*, rows: Sequence[Mapping], backend: str, nranks: int) -> CheckResult:
    if not rows:
        return CheckResult("smoke: bandwidth", SKIP, "no bandwidth measured")
    best = max(rows, key=lambda row: row["busbw_gbps"])
    detail = (
        f"peak busbw {best['busbw_gbps']:.2f} GB/s (algbw {best['algbw_gbps']:.2f} GB/s) at "
        f"{human_bytes(best['bytes'])}, {nranks} ranks on {backend}; {len(rows)} sizes up to {human_bytes(rows[-1]['bytes'])}"
    )
    return CheckResult("smoke: bandwidth", OK, detail)
