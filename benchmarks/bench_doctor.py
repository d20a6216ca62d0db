"""How long `ddprun doctor` takes, with and without the live smoke test.

    python benchmarks/bench_doctor.py [--runs 5] [--smoke-runs 3]

Targets: without the smoke test, under 1 s beyond `import torch`; with it, under 30 s on a
2-core CPU machine. "Beyond import torch" is the doctor's median wall time minus the median
wall time of `python -c "import torch"`, both measured in this run, alternating, so that a
busy or cold machine slows both alike.

Runs the `doctor` command of the ddprun CLI when it has one, else calls run_doctor directly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import ROOT, machine, wall_time  # noqa: E402
# The same split inside one process, immune to load differences between processes.
IN_PROCESS = """
import io, json, time
started = time.perf_counter()
import torch
imported = time.perf_counter()
from rich.console import Console
from ddprun.doctor.main import run_doctor
run_doctor(smoke=False, console=Console(file=io.StringIO()))
print(json.dumps({"import_torch_s": imported - started, "doctor_s": time.perf_counter() - imported}))
"""


def doctor_command(*, smoke: bool) -> list[str]:
    return [sys.executable, "-m", "ddprun", "doctor"] + ([] if smoke else ["--no-smoke"])


def in_process() -> dict:
    done = subprocess.run([sys.executable, "-c", IN_PROCESS], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of the fast measurements")
    parser.add_argument("--smoke-runs", type=int, default=3, help="runs of the full doctor")
    args = parser.parse_args()

    import_torch = [sys.executable, "-c", "import torch"]
    no_smoke, with_smoke = doctor_command(smoke=False), doctor_command(smoke=True)
    wall_time(import_torch)  # warm the page cache once, for both
    torch_times, doctor_times, codes = [], [], []
    for _ in range(args.runs):
        torch_times.append(wall_time(import_torch)[0])
        seconds, code = wall_time(no_smoke)
        doctor_times.append(seconds)
        codes.append(code)
    inside = [in_process() for _ in range(args.runs)]
    smoke_runs = [wall_time(with_smoke) for _ in range(args.smoke_runs)]

    torch_s = statistics.median(torch_times)
    doctor_s = statistics.median(doctor_times)
    smoke_s = statistics.median(seconds for seconds, _ in smoke_runs)
    result = {
        "machine": machine(),
        "command_no_smoke": " ".join(no_smoke[1:]),
        "command_smoke": " ".join(with_smoke[1:]),
        "import_torch_s": round(torch_s, 3),
        "doctor_no_smoke_s": round(doctor_s, 3),
        "beyond_import_torch_s": round(doctor_s - torch_s, 3),
        "in_process_doctor_after_import_torch_s": round(statistics.median(r["doctor_s"] for r in inside), 3),
        "doctor_with_smoke_s": round(smoke_s, 3),
        "exit_codes": sorted(set(codes + [code for _, code in smoke_runs])),
        "runs": {"fast": args.runs, "smoke": args.smoke_runs},
    }
    print(f"| measurement (median) | seconds | target |")
    print(f"| --- | --- | --- |")
    print(f"| `python -c 'import torch'` | {torch_s:.2f} | |")
    print(f"| doctor --no-smoke | {doctor_s:.2f} | |")
    print(f"| doctor --no-smoke beyond import torch | {doctor_s - torch_s:.2f} | < 1 |")
    print(f"| doctor --no-smoke after torch is imported, same process | {result['in_process_doctor_after_import_torch_s']:.2f} | < 1 |")
    print(f"| doctor with smoke test (2 ranks, gloo, up to 64 MiB) | {smoke_s:.2f} | < 30 |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
