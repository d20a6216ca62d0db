"""How fast ddprun starts, next to torchrun: --help, --dry-run, and a whole 2-process CPU job.

    python benchmarks/bench_launch.py [--runs 7] [--job-runs 7]

Targets (ratio of medians, ddprun / torchrun):
  ddprun --help                     vs torchrun --help   <= 0.1
  ddprun run --dry-run x.py         vs torchrun --help   <= 0.1
  ddprun tr<TAB> (bash completion)  vs torchrun --help   <= 0.1
  ddprun run --cpu --nproc 2 x.py   vs torchrun --nproc-per-node 2 --standalone x.py   <= 1.05
The job's script (written to a temp dir as job.py) initialises gloo, all-reduces one tensor
and exits, noting the time at each step, so the job's wall time also splits into phases:
launcher start to first worker start, the workers' own run, last worker done to launcher exit.
Every measurement is a fresh process; the commands compared run in turns after one discarded
warm-up round, with OMP_NUM_THREADS=1 for both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved, load_average, machine, stats, take_records, torch_version, venv_command  # noqa: E402

# The 2-process job. Each rank appends its time stamps, one JSON line, to $STAMPS.
JOB = """\
import json, os, time
start = time.time()
import torch, torch.distributed as dist
imported = time.time()
dist.init_process_group("gloo")
tensor = torch.ones(1)
dist.all_reduce(tensor)
assert tensor.item() == dist.get_world_size()
dist.destroy_process_group()
with open(os.environ["STAMPS"], "a") as stamps:
    stamps.write(json.dumps({"start": start, "imported": imported, "done": time.time()}) + "\\n")
"""
DRY_RUN_SCRIPT = "tests/scripts/allreduce.py"  # never started: any existing script does


def commands(job: str) -> tuple[dict, dict]:
    ddprun = venv_command("ddprun", "ddprun")
    torchrun = venv_command("torchrun", "torch.distributed.run")
    # Flags go before the script: everything after it is the script's own arguments.
    fast = {
        "ddprun --help": ddprun + ["--help"],
        "torchrun --help": torchrun + ["--help"],
        f"ddprun run --dry-run {DRY_RUN_SCRIPT}": ddprun + ["run", "--dry-run", DRY_RUN_SCRIPT],
        # What bash runs on `ddprun tr<TAB>` (the script from `ddprun --show-completion bash`).
        "ddprun completion (tr<TAB>)": ["env", "_DDPRUN_COMPLETE=complete_bash", "COMP_WORDS=ddprun tr", "COMP_CWORD=1",
                                        *ddprun],
    }
    jobs = {
        "ddprun run --cpu --nproc 2 job.py": ddprun + ["run", "--cpu", "--nproc", "2", job],
        "torchrun --nproc-per-node 2 --standalone job.py": torchrun + ["--nproc-per-node", "2", "--standalone", job],
    }
    return fast, jobs


def job_env(scratch: str) -> dict[str, str]:
    # TMPDIR keeps both launchers' per-job folders (ddprun's logs, torchelastic_*) in scratch;
    # without XDG_RUNTIME_DIR, ddprun's per-user log folder is TMPDIR/ddprun-<uid>.
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    return {**env, "OMP_NUM_THREADS": "1", "STAMPS": os.path.join(scratch, "stamps.jsonl"), "TMPDIR": scratch}


def rows(samples: dict[str, list[float]], *, pairs: list[tuple[str, str, float]]) -> list[dict]:
    """One row per command; a compared command gets its ratio to its baseline and the target."""
    table = []
    compared = {name: (base, target) for name, base, target in pairs}
    for name, times in samples.items():
        row = {"command": name, **vars(stats(times))}
        if name in compared:
            base, target = compared[name]
            row["ratio"] = row["median"] / statistics.median(samples[base])
            # Ratio of each turn to the baseline's run right beside it: less sensitive to load drifts.
            row["paired_ratio"] = statistics.median(a / b for a, b in zip(times, samples[base]))
            row["baseline"], row["target"], row["pass"] = base, target, row["ratio"] <= target
        table.append(row)
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| command | median s | min s | max s | ratio | target | result |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in table:
        ratio = f"{row['ratio']:.3f}" if "ratio" in row else ""
        target = f"<= {row['target']} x `{row['baseline']}`" if "target" in row else "(baseline)"
        verdict = ("pass" if row["pass"] else "FAIL") if "pass" in row else ""
        lines.append(
            f"| `{row['command']}` | {row['median']:.3f} | {row['min']:.3f} | {row['max']:.3f} | {ratio} | {target} | {verdict} |"
        )
    return "\n".join(lines)


class Phases:
    """Splits each measured job run by its ranks' time stamps (all from one clock: time.time)."""

    def __init__(self, stamps: Path) -> None:
        self.stamps = stamps
        self.rows: dict[str, list[dict[str, float]]] = {}

    def __call__(self, name: str, started: float, seconds: float, measured: bool) -> None:
        ranks = take_records(self.stamps)
        if not measured:
            return
        if len(ranks) != 2:
            raise SystemExit(f"{name}: expected time stamps from 2 ranks, got {len(ranks)}")
        self.rows.setdefault(name, []).append({
            "launcher start -> first rank starts": min(r["start"] for r in ranks) - started,
            "rank: import torch": statistics.mean(r["imported"] - r["start"] for r in ranks),
            "rank: gloo init, all-reduce, destroy": statistics.mean(r["done"] - r["imported"] for r in ranks),
            "last rank done -> launcher exits": started + seconds - max(r["done"] for r in ranks),
        })

    def medians(self) -> dict[str, dict[str, float]]:
        return {
            name: {phase: statistics.median(row[phase] for row in rows) for phase in rows[0]}
            for name, rows in self.rows.items()
        }


def phases_markdown(medians: dict[str, dict[str, float]]) -> str:
    names = list(medians)
    phases = list(medians[names[0]])
    lines = [
        "| phase (median s) | " + " | ".join(f"`{name}`" for name in names) + " | ddprun - torchrun |",
        "| --- |" + " --- |" * (len(names) + 1),
    ]
    for phase in phases:
        values = [medians[name][phase] for name in names]
        lines.append(f"| {phase} | " + " | ".join(f"{v:.3f}" for v in values) + f" | {values[0] - values[-1]:+.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="measured rounds of --help and --dry-run")
    parser.add_argument("--job-runs", type=int, default=7, help="measured rounds of the 2-process job")
    args = parser.parse_args()

    load_before, began = load_average(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_launch_") as scratch:
        job = Path(scratch, "job.py")
        job.write_text(JOB)
        fast, jobs = commands(str(job))
        env = job_env(scratch)
        phases = Phases(Path(env["STAMPS"]))
        samples = interleaved(fast, runs=args.runs, env=env)
        samples.update(interleaved(jobs, runs=args.job_runs, env=env, observe=phases))
    names_fast, names_job = list(fast), list(jobs)
    table = rows(samples, pairs=[
        (names_fast[0], names_fast[1], 0.1),
        (names_fast[2], names_fast[1], 0.1),
        (names_fast[3], names_fast[1], 0.1),
        (names_job[0], names_job[1], 1.05),
    ])
    print(markdown(table))
    print()
    print(phases_markdown(phases.medians()))
    print()
    print(f"- machine: {machine()}, torch {torch_version()}")
    print(f"- load average (1/5/15 min): {load_before} before, {load_average()} after")
    print(f"- rounds: {args.runs} (--help, --dry-run), {args.job_runs} (job), each after 1 discarded warm-up round;"
          f" OMP_NUM_THREADS=1; {time.perf_counter() - began:.0f} s in all")
    if os.getloadavg()[0] > (os.cpu_count() or 1):
        print("- warning: the 1-minute load average exceeds the core count; rerun on a quieter machine")
    print(json.dumps({"machine": machine(), "torch": torch_version(), "load_before": load_before,
                      "load_after": load_average(), "rows": table, "phases": phases.medians()}))


if __name__ == "__main__":
    main()
