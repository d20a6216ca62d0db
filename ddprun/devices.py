"""GPUs: the machine's inventory, what CUDA_VISIBLE_DEVICES exposes, and what --gpus selects.

Indices are nvidia-smi / NVML indices, which follow PCI bus order. CUDA's own default order
(CUDA_DEVICE_ORDER=FASTEST_FIRST) can number the same cards differently, so the launch plan
adds DEVICE_ORDER_ENV to the workers' environment: "GPU 3" then means the same card to
ddprun, to nvidia-smi and to CUDA inside every worker.

Everything here is a pure function of its inputs except the two probes, read_inventory()
and read_driver_version(). No torch: this module is imported for --help and --dry-run.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

from ddprun.errors import DdprunError, UsageError

_T = TypeVar("_T")

VISIBLE_DEVICES_VAR = "CUDA_VISIBLE_DEVICES"

# Added to every worker's environment so that CUDA numbers GPUs as nvidia-smi does.
DEVICE_ORDER_ENV = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@dataclass(frozen=True)
class Gpu:
    """One physical GPU from the inventory."""

    index: int  # nvidia-smi / NVML index (PCI bus order)
    uuid: str  # "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
    name: str
    memory_mib: int  # 0 when the driver does not report it


@dataclass(frozen=True)
class VisibleGpu:
    """One device as a CUDA process will see it, in CUDA's enumeration order."""

    entry: str  # the CUDA_VISIBLE_DEVICES entry that names it; str(index) when the variable is unset
    gpu: Gpu | None  # None only for a MIG entry that can't be matched to the inventory


# ---------------------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES
# ---------------------------------------------------------------------------------------

_INDEX = re.compile(r"[0-9]+")
_UUID_PREFIX = re.compile(r"GPU-[0-9A-Fa-f-]+")
# MIG-<GPU-UUID>/<GPU instance>/<compute instance> (drivers before R470) or MIG-<UUID> (R470+).
_MIG_OLD = re.compile(r"MIG-(GPU-[0-9A-Fa-f-]+)/[0-9]+/[0-9]+")
_MIG_NEW = re.compile(r"MIG-[0-9A-Fa-f-]+")


def visible_gpus(cuda_visible_devices: str | None, inventory: Sequence[Gpu]) -> list[VisibleGpu]:
    """The devices a CUDA process would see, read the way CUDA reads CUDA_VISIBLE_DEVICES.

    None (unset) exposes the whole inventory; "" or a lone "-1" exposes nothing. Entries are
    indices, GPU-<uuid> (a unique prefix is enough) or MIG-... ids. CUDA silently stops at the
    first entry it can't use; every such entry is a UsageError here instead, as are repeats.
    One trailing comma is tolerated: CUDA then exposes exactly what is written.
    With an empty inventory (no driver found) nothing is visible; the syntax is still checked.
    """
    if cuda_visible_devices is None:
        return [VisibleGpu(entry=str(gpu.index), gpu=gpu) for gpu in inventory]
    entries = _split_entries(cuda_visible_devices)
    for position, entry in enumerate(entries):
        _check_syntax(entry, value=cuda_visible_devices, before=entries[:position])
    if not inventory:
        # No driver to resolve against, but a literal repeat is still a mistake.
        _reject_repeats([VisibleGpu(entry=entry, gpu=None) for entry in entries], value=cuda_visible_devices)
        return []
    resolved = [
        _resolve_entry(entry, value=cuda_visible_devices, before=entries[:position], inventory=inventory)
        for position, entry in enumerate(entries)
    ]
    _reject_repeats(resolved, value=cuda_visible_devices)
    return resolved


def hides_all_gpus(cuda_visible_devices: str | None) -> bool:
    """True for the values that deliberately expose no GPU: "", whitespace, or a lone -1."""
    return cuda_visible_devices is not None and not _split_entries(cuda_visible_devices)


def _split_entries(value: str) -> list[str]:
    entries = [entry.strip() for entry in value.split(",")]
    if entries == [""] or entries == ["-1"]:
        return []
    if len(entries) > 1 and entries[-1] == "":
        entries.pop()  # "0,1," -> CUDA stops at the empty entry, after exposing exactly 0,1
    return entries


def _quoted(value: str) -> str:
    return f'{VISIBLE_DEVICES_VAR}="{value}"'


def _cuda_would_expose(before: Sequence[str]) -> str:
    if not before:
        return "no GPU"
    return "only " + ",".join(before)


def _check_syntax(entry: str, *, value: str, before: Sequence[str]) -> None:
    stops = f"CUDA would stop reading there and expose {_cuda_would_expose(before)}"
    if entry == "-1":
        raise UsageError(
            f"{_quoted(value)}: entry -1 makes CUDA ignore it and every entry after it, "
            f"so CUDA would expose {_cuda_would_expose(before)}",
            hint=_minus_one_hint(value),
        )
    if entry == "":
        raise UsageError(f"{_quoted(value)} has an empty entry: {stops}", hint=_syntax_hint())
    if any(pattern.fullmatch(entry) for pattern in (_INDEX, _UUID_PREFIX, _MIG_OLD, _MIG_NEW)):
        return
    raise UsageError(
        f'{_quoted(value)}: entry "{entry}" is not a GPU index, GPU-<uuid> or MIG-<uuid>: {stops}',
        hint=_syntax_hint(),
    )


def _minus_one_hint(value: str) -> str:
    kept = [entry.strip() for entry in value.split(",") if entry.strip() not in ("-1", "")]
    if not kept:
        return f"To hide every GPU, set {VISIBLE_DEVICES_VAR}=-1 alone."
    return (
        f"To hide every GPU, set {VISIBLE_DEVICES_VAR}=-1 alone; "
        f"otherwise drop the -1: {VISIBLE_DEVICES_VAR}={','.join(kept)}"
    )


def _syntax_hint() -> str:
    return (
        f"Write comma-separated indices as nvidia-smi numbers them ({VISIBLE_DEVICES_VAR}=0,1), "
        "or GPU UUIDs as `nvidia-smi -L` prints them."
    )


def _resolve_entry(entry: str, *, value: str, before: Sequence[str], inventory: Sequence[Gpu]) -> VisibleGpu:
    if _INDEX.fullmatch(entry):
        return VisibleGpu(entry=entry, gpu=_gpu_by_index(entry, value=value, before=before, inventory=inventory))
    if entry.startswith("GPU-"):
        return VisibleGpu(entry=entry, gpu=_gpu_by_uuid(entry, value=value, before=before, inventory=inventory))
    old_style = _MIG_OLD.fullmatch(entry)
    if old_style:  # the parent GPU is named inside the id, so it must exist
        parent = _gpu_by_uuid(old_style.group(1), value=value, before=before, inventory=inventory)
        return VisibleGpu(entry=entry, gpu=parent)
    return VisibleGpu(entry=entry, gpu=None)  # MIG-<uuid>: the inventory lists whole GPUs only


def _gpu_by_index(entry: str, *, value: str, before: Sequence[str], inventory: Sequence[Gpu]) -> Gpu:
    wanted = int(entry)
    for gpu in inventory:
        if gpu.index == wanted:
            return gpu
    raise UsageError(
        f"{_quoted(value)}: entry {entry} is out of range ({_machine_has(inventory)})",
        hint=f"CUDA would stop reading there and expose {_cuda_would_expose(before)}. "
        "`nvidia-smi -L` lists this machine's GPUs.",
    )


def _machine_has(inventory: Sequence[Gpu]) -> str:
    indices = sorted(gpu.index for gpu in inventory)
    if len(indices) == 1:
        return f"this machine has GPU {indices[0]}"
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return f"this machine has GPUs {indices[0]}-{indices[-1]}"
    return "this machine has GPUs " + ",".join(str(index) for index in indices)


def _gpu_by_uuid(prefix: str, *, value: str, before: Sequence[str], inventory: Sequence[Gpu]) -> Gpu:
    matches = [gpu for gpu in inventory if gpu.uuid.startswith(prefix)]
    if len(matches) == 1:
        return matches[0]
    listing = "; ".join(f"{gpu.index}: {gpu.uuid}" for gpu in (matches or inventory))
    if matches:
        raise UsageError(
            f"{_quoted(value)}: {prefix} is ambiguous, it matches {len(matches)} GPUs ({listing})",
            hint="Write enough of the UUID to name one GPU (CUDA needs a unique prefix).",
        )
    folded = [gpu for gpu in inventory if gpu.uuid.lower().startswith(prefix.lower())]
    hint = f"Did you mean {folded[0].uuid}? UUIDs are case-sensitive." if len(folded) == 1 else None
    raise UsageError(
        f"{_quoted(value)}: {prefix} matches no GPU on this machine ({listing or 'no GPU found'})",
        hint=hint or f"CUDA would stop reading there and expose {_cuda_would_expose(before)}.",
    )


def _reject_repeats(resolved: Sequence[VisibleGpu], *, value: str) -> None:
    seen: dict[object, VisibleGpu] = {}
    for visible in resolved:
        # Two MIG instances of one GPU are distinct devices; whole GPUs are compared by index.
        key = _repeat_key(visible)
        first = seen.setdefault(key, visible)
        if first is visible:
            continue
        same = "is repeated" if first.entry == visible.entry else f"and {visible.entry} both name GPU {key}"
        kept = ",".join(dict.fromkeys(v.entry for v in resolved if v is not visible))
        raise UsageError(
            f"{_quoted(value)}: entry {first.entry} {same}; each GPU may appear once",
            hint=f"Remove the repeat, e.g. {VISIBLE_DEVICES_VAR}={kept}",
        )


def _repeat_key(visible: VisibleGpu) -> object:
    if visible.entry.startswith("MIG-"):
        return ("mig", visible.entry)
    if visible.gpu is None:  # unresolved: compare what is written, with indices as numbers
        return int(visible.entry) if visible.entry.isdigit() else visible.entry
    return visible.gpu.index


def visible_devices_value(selected: Sequence[VisibleGpu]) -> str:
    """The CUDA_VISIBLE_DEVICES value that exposes exactly `selected`, in that order."""
    return ",".join(visible.entry for visible in selected)


# ---------------------------------------------------------------------------------------
# --gpus
# ---------------------------------------------------------------------------------------

_GPUS_FORMS = "use --gpus 2 (a count), --gpus 0,2 (positions among the visible GPUs) or --gpus all"


def select_gpus(
    request: str | None, visible: Sequence[VisibleGpu], *, cuda_visible_devices: str | None
) -> list[VisibleGpu]:
    """Resolve --gpus against the visible GPUs.

    None or "all": every visible GPU. "N": the first N (a single integer is a count).
    "0,2" or "1,": these ordinals among the visible GPUs, in the order given.
    """
    text = "all" if request is None else request.strip()
    if text.lower() == "all":
        _require_some(visible, cuda_visible_devices=cuda_visible_devices)
        return list(visible)
    if "," in text:
        ordinals = _parse_ordinals(text)
        _require_some(visible, cuda_visible_devices=cuda_visible_devices)
        _check_ordinals(ordinals, text=text, visible=visible, cuda_visible_devices=cuda_visible_devices)
        return [visible[ordinal] for ordinal in ordinals]
    count = _parse_count(text)
    _require_some(visible, cuda_visible_devices=cuda_visible_devices)
    if count > len(visible):
        raise UsageError(_too_many(count, available=len(visible), cuda_visible_devices=cuda_visible_devices))
    return list(visible[:count])


def _parse_count(text: str) -> int:
    if not _INDEX.fullmatch(text):
        raise UsageError(f'--gpus "{text}" is not a GPU count or list: {_GPUS_FORMS}')
    count = int(text)
    if count == 0:
        raise UsageError("--gpus 0 asks for no GPU: use --gpus 1 or more, or --cpu to run without GPUs")
    return count


def _parse_ordinals(text: str) -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    if len(parts) > 1 and parts[-1] == "":
        parts.pop()  # "1," is the one-ordinal form
    if not all(_INDEX.fullmatch(part) for part in parts):
        raise UsageError(f'--gpus "{text}" is not a GPU count or list: {_GPUS_FORMS}')
    ordinals = [int(part) for part in parts]
    repeated = [ordinal for position, ordinal in enumerate(ordinals) if ordinal in ordinals[:position]]
    if repeated:
        raise UsageError(f"--gpus {text} names ordinal {repeated[0]} twice: each GPU may appear once")
    return ordinals


def _check_ordinals(
    ordinals: Sequence[int], *, text: str, visible: Sequence[VisibleGpu], cuda_visible_devices: str | None
) -> None:
    outside = [ordinal for ordinal in ordinals if ordinal >= len(visible)]
    if not outside:
        return
    last = len(visible) - 1
    span = "ordinal 0" if last == 0 else f"ordinals 0-{last}"
    plural = "GPU" if len(visible) == 1 else "GPUs"
    hint = None
    if cuda_visible_devices is None:
        where = f"this machine has {len(visible)} {plural}"
    else:
        where = f"{_bare(cuda_visible_devices)} exposes {len(visible)} {plural}"
        hint = "--gpus counts positions among the visible GPUs, not physical indices: " + ", ".join(
            f"{ordinal} = {describe_gpu(v)}" for ordinal, v in enumerate(visible)
        )
    raise UsageError(f"--gpus {text}: ordinal {outside[0]} is out of range; {where} ({span})", hint=hint)


def _too_many(count: int, *, available: int, cuda_visible_devices: str | None) -> str:
    if cuda_visible_devices is None:
        return f"{count} GPUs requested, but this machine has {available}: use --gpus {available}"
    return (
        f"{count} GPUs requested, but {_bare(cuda_visible_devices)} exposes {available}: "
        f"use --gpus {available}, or widen {VISIBLE_DEVICES_VAR}"
    )


def _bare(value: str) -> str:
    """VAR=value as a person would type it; quoted only when the value needs it."""
    needs_quotes = value == "" or any(char.isspace() for char in value)
    return _quoted(value) if needs_quotes else f"{VISIBLE_DEVICES_VAR}={value}"


def _require_some(visible: Sequence[VisibleGpu], *, cuda_visible_devices: str | None) -> None:
    if visible:
        return
    if hides_all_gpus(cuda_visible_devices):
        raise UsageError(
            f"No GPU is visible: {_quoted(cuda_visible_devices or '')} hides every GPU",
            hint=f"Use --cpu to run on CPU, or unset {VISIBLE_DEVICES_VAR}.",
        )
    reason = "no NVIDIA GPU was found on this machine"
    if cuda_visible_devices is not None:
        reason += f" ({_quoted(cuda_visible_devices)} names GPUs, but no driver reports any)"
    raise UsageError(
        f"No GPU is visible: {reason}",
        hint="Use --cpu to run on CPU; `ddprun doctor` checks the driver.",
    )


def describe_gpu(visible: VisibleGpu, *, ordinal: int | None = None) -> str:
    """One line for the plan panel, e.g. "cuda:0 = GPU 3 (NVIDIA H100 80GB HBM3, 81559 MiB)"."""
    gpu = visible.gpu
    if visible.entry.startswith("MIG-"):
        text = f"MIG {visible.entry}" + (f" on GPU {gpu.index} ({gpu.name})" if gpu else "")
    elif gpu is None:
        text = visible.entry
    else:
        memory = f", {gpu.memory_mib} MiB" if gpu.memory_mib else ""
        text = f"GPU {gpu.index} ({gpu.name}{memory})"
    return text if ordinal is None else f"cuda:{ordinal} = {text}"


# ---------------------------------------------------------------------------------------
# Inventory: NVML first, then nvidia-smi, else no GPU
# ---------------------------------------------------------------------------------------

_MIB = 1024 * 1024

_SMI = "nvidia-smi"
_SMI_TIMEOUT_S = 10.0  # a cold driver on a large machine takes a few seconds
_SMI_INVENTORY_ARGS = ("--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits")
_SMI_DRIVER_ARGS = ("--query-gpu=driver_version", "--format=csv,noheader")
_DRIVER_VERSION = re.compile(r"[0-9]+(\.[0-9]+)+")


def read_inventory() -> list[Gpu]:
    """This machine's GPUs: NVML when the driver library loads, else nvidia-smi, else [].

    Never raises for a missing or broken driver: "no GPU" is the answer then.
    """
    gpus = _read_nvml_inventory()
    if gpus is not None:
        return gpus
    output = _run_smi(_SMI_INVENTORY_ARGS)
    if output is None:
        return []
    try:
        return parse_inventory_csv(output)
    except DdprunError:
        return []


def read_driver_version() -> str | None:
    """The NVIDIA driver version ("550.54.15"), or None when no driver answers."""
    version = _read_nvml_driver_version()
    if version is not None:
        return version
    output = _run_smi(_SMI_DRIVER_ARGS)
    lines = [line.strip() for line in (output or "").splitlines() if line.strip()]
    if lines and _DRIVER_VERSION.fullmatch(lines[0]):
        return lines[0]
    return None


def parse_inventory_csv(text: str) -> list[Gpu]:
    """Parse `nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,nounits`."""
    gpus = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            gpus.append(_parse_inventory_line(line, number=number))
    return gpus


def _parse_inventory_line(line: str, *, number: int) -> Gpu:
    fields = [field.strip() for field in line.split(",")]
    problem = f'cannot read line {number} of nvidia-smi\'s GPU list: "{line.strip()}"'
    if len(fields) < 4:
        raise DdprunError(problem, hint="Expected: index, uuid, name, memory.total (MiB).")
    index, uuid, memory = fields[0], fields[1], fields[-1]
    name = ", ".join(fields[2:-1])  # a name containing a comma is split across fields
    if not _INDEX.fullmatch(index) or not uuid.startswith("GPU-") or not name:
        raise DdprunError(problem, hint="Expected: index, uuid, name, memory.total (MiB).")
    return Gpu(index=int(index), uuid=uuid, name=name, memory_mib=_parse_memory(memory, problem=problem))


def _parse_memory(field: str, *, problem: str) -> int:
    if field.endswith(" MiB"):  # present when the query was made without "nounits"
        field = field[: -len(" MiB")]
    if _INDEX.fullmatch(field):
        return int(field)
    if field in ("N/A", "[N/A]", "[Not Supported]"):  # e.g. GPUs sharing system memory
        return 0
    raise DdprunError(problem, hint="memory.total should be a number of MiB.")


def _run_smi(args: Sequence[str]) -> str | None:
    """nvidia-smi's stdout, or None when it is absent, fails, or hangs."""
    executable = shutil.which(_SMI)
    if executable is None:
        return None
    try:
        done = subprocess.run(
            [executable, *args],
            capture_output=True,
            text=True,
            encoding="utf-8",
            errors="replace",
            timeout=_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _read_nvml_inventory() -> list[Gpu] | None:
    """The GPUs as NVML lists them, or None when NVML is missing or fails (nvidia-smi is next)."""
    return _with_nvml(_nvml_gpus)


def _read_nvml_driver_version() -> str | None:
    return _with_nvml(lambda pynvml: _text(pynvml.nvmlSystemGetDriverVersion()) or None)


# NVML talks to the kernel driver through these device nodes (/dev/dxg under WSL2); without
# any of them there is no driver to ask, and importing the bindings would be time lost on every
# --dry-run of a CPU machine.
_DRIVER_NODES = ("/dev/nvidiactl", "/dev/dxg")


def _driver_present() -> bool:
    return any(os.path.exists(node) for node in _DRIVER_NODES)


def _with_nvml(read: Callable[[Any], _T]) -> _T | None:
    """read(pynvml) inside an initialised NVML session; None when NVML is missing or any call fails."""
    if not _driver_present():
        return None
    try:
        import pynvml  # nvidia-ml-py: NVIDIA's own bindings, imported only when the inventory is read
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()  # loads libnvidia-ml.so.1; NVMLError_LibraryNotFound without a driver
    except pynvml.NVMLError:
        return None
    try:
        return read(pynvml)
    except pynvml.NVMLError:
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _nvml_gpus(pynvml: Any) -> list[Gpu]:
    gpus = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        name = _text(pynvml.nvmlDeviceGetName(handle))
        gpus.append(Gpu(index=index, uuid=uuid, name=name, memory_mib=_nvml_memory_mib(pynvml, handle)))
    return gpus


def _nvml_memory_mib(pynvml: Any, handle: object) -> int:
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // _MIB
    except pynvml.NVMLError_NotSupported:  # GPUs that share system memory report none
        return 0


def _text(value: str | bytes) -> str:
    # nvidia-ml-py returns str; releases before 11.515 returned bytes.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
