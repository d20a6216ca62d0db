"""A fake `nvidia-smi` for tests: put it first on PATH to fake a GPU machine.

    stub = install_stub_nvidia_smi(tmp_path / "bin", FOUR_GPUS)
    monkeypatch.setenv("PATH", path_with(stub.parent))

It answers `nvidia-smi` (a summary table), `nvidia-smi -L`, and
`nvidia-smi --query-gpu=FIELD,... --format=csv[,noheader][,nounits]` for the fields in
_FIELDS below, and exits 0. Other arguments, or an unknown field, exit 2 like the real tool.

On a machine with a real driver, ddprun reads NVML before nvidia-smi, so the stub is
only consulted where NVML does not load (e.g. CI machines without GPUs).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Sequence

# (index, uuid, name, memory MiB), as a machine with four H100s reports them.
FOUR_GPUS: list[tuple[int, str, str, int]] = [
    (0, "GPU-8f2a6c1e-3b4d-4e5f-9a0b-1c2d3e4f5a6b", "NVIDIA H100 80GB HBM3", 81559),
    (1, "GPU-1b7e9d20-5c6f-4a8b-8c9d-0e1f2a3b4c5d", "NVIDIA H100 80GB HBM3", 81559),
    (2, "GPU-8f91a3b4-7d8e-4f90-a1b2-c3d4e5f6a7b8", "NVIDIA H100 80GB HBM3", 81559),
    (3, "GPU-c4d5e6f7-0a1b-4c2d-b3e4-f5a6b7c8d9e0", "NVIDIA H100 80GB HBM3", 81559),
]

_SCRIPT = r'''#!{python} -IS
import json, sys

GPUS = json.loads({gpus!r})
DRIVER = {driver!r}
CUDA = {cuda!r}
RAW = {raw!r}
EXIT = {exit_code!r}


def field(gpu, name, units):
    memory = lambda mib: str(mib) + (" MiB" if units else "")
    values = {{
        "index": str(gpu["index"]),
        "uuid": gpu["uuid"], "gpu_uuid": gpu["uuid"],
        "name": gpu["name"], "gpu_name": gpu["name"],
        "memory.total": memory(gpu["memory"]),
        "memory.used": memory(0),
        "memory.free": memory(gpu["memory"]),
        "driver_version": DRIVER,
        "count": str(len(GPUS)),
        "pci.bus_id": "00000000:%02X:00.0" % (0x18 + 0x10 * gpu["index"]),
        "compute_cap": "9.0",
    }}
    return values.get(name)


def query(spec, fmt):
    names = [name.strip() for name in spec.split(",")]
    options = fmt.split(",")
    if options[0] != "csv":
        sys.exit("stub nvidia-smi: only --format=csv is supported")
    units = "nounits" not in options
    probe = {{"index": 0, "uuid": "", "name": "", "memory": 0}}
    for name in names:
        if field(probe, name, units) is None:
            print('Field "%s" is not a valid field to query.' % name, file=sys.stderr)
            sys.exit(2)
    if "noheader" not in options:
        print(", ".join(name + (" [MiB]" if units and name.startswith("memory.") else "") for name in names))
    for gpu in GPUS:
        print(", ".join(field(gpu, name, units) for name in names))


def table():
    print("+" + "-" * 77 + "+")
    print("| NVIDIA-SMI %s    Driver Version: %s    CUDA Version: %s |" % (DRIVER, DRIVER, CUDA))
    print("+" + "-" * 77 + "+")
    for gpu in GPUS:
        print("| %3d  %-40s | %8d MiB |" % (gpu["index"], gpu["name"], gpu["memory"]))
    print("+" + "-" * 77 + "+")
    if not GPUS:
        print("No devices were found")


def main(argv):
    if RAW is not None:
        sys.stdout.write(RAW)
        sys.exit(EXIT)
    options = dict(arg.split("=", 1) if "=" in arg else (arg, "") for arg in argv)
    if not argv:
        table()
    elif argv == ["-L"]:
        for gpu in GPUS:
            print("GPU %d: %s (UUID: %s)" % (gpu["index"], gpu["name"], gpu["uuid"]))
    elif set(options) == {{"--query-gpu", "--format"}}:
        query(options["--query-gpu"], options["--format"])
    else:
        print("stub nvidia-smi: unsupported arguments: %s" % " ".join(argv), file=sys.stderr)
        sys.exit(2)
    sys.exit(EXIT)


main(sys.argv[1:])
'''


def install_stub_nvidia_smi(
    directory: Path,
    gpus: Sequence[tuple[int, str, str, int]],
    *,
    driver_version: str = "550.54.15",
    cuda_version: str = "12.4",
    stdout: str | None = None,
    exit_code: int = 0,
) -> Path:
    """Write an executable `nvidia-smi` into `directory` and return its path.

    `gpus` are (index, uuid, name, memory MiB). With `stdout`, the stub prints exactly that
    for any arguments and exits with `exit_code` (to fake a broken driver).
    """
    directory.mkdir(parents=True, exist_ok=True)
    records = [{"index": i, "uuid": u, "name": n, "memory": m} for i, u, n, m in gpus]
    script = _SCRIPT.format(
        python=sys.executable,
        gpus=json.dumps(records),
        driver=driver_version,
        cuda=cuda_version,
        raw=stdout,
        exit_code=exit_code,
    )
    path = directory / "nvidia-smi"
    path.write_text(script, encoding="utf-8")
    path.chmod(0o755)
    return path


def path_with(directory: Path, path: str | None = None) -> str:
    """A PATH value with `directory` first (default: the current PATH after it)."""
    rest = os.environ.get("PATH", "") if path is None else path
    return os.pathsep.join([str(directory), rest]) if rest else str(directory)
