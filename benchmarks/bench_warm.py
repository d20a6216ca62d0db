"""Warm start against torchrun: a 2-process and an 8-process gloo job, a restart, the trainer's first step.

    python benchmarks/bench_warm.py [--runs 3] [--only job2,job8,restart,train]

Targets (ratio of medians, ddprun --warm-start / torchrun):
  2-process job (init, all-reduce, exit)      ddprun run --cpu --nproc 2 --warm-start   <= 0.6
  8-process job                               ddprun run --cpu --nproc 8 --warm-start   <= 0.4
  a restart (rank 1 SIGKILLs itself once, before joining gloo; from its death to every rank done
    again: gloo init and an all-reduce in the new attempt)                                  <= 0.5
  the trainer to its first optimizer step (resnet18, 32x32, batch 32 per rank; the example's
    FakeData, the trainer's synthetic data): from the launcher's start to the moment every rank
    has finished its first optimizer step     ddprun train   <= 0.6
    against `torchrun examples/train.py`. first_step/sitecustomize.py stamps each rank's first
    step through torch's global optimizer hook, the same way under both launchers.
`ddprun run --fresh-start` is measured beside them (the default of `ddprun run`). Every command
of a group runs in turns (A B C A B C ...) after one discarded warm-up round, OMP_NUM_THREADS=1.
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
from _timing import ROOT, interleaved, load_average, machine, take_records, torch_version, venv_command  # noqa: E402

# Each rank appends one JSON line of time stamps to $STAMPS; MODE=restart: rank 1 dies once.
JOB = """\
import json, os, signal, time
start = time.time()
import torch, torch.distributed as dist
imported = time.time()
attempt, rank = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(os.environ["RANK"])
dies = os.environ.get("MODE") == "restart" and attempt == 0 and rank == 1
if not dies:  # rank 1 dies before gloo: torchrun's restart reuses its store, where its address stays
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1))
record = {"attempt": attempt, "rank": rank, "start": start, "imported": imported, "done": time.time()}
with open(os.environ["STAMPS"], "a") as stamps:
    stamps.write(json.dumps(record) + "\\n")
if dies:
    os.kill(os.getpid(), signal.SIGKILL)
dist.destroy_process_group()
"""
TRAIN_STEP = ["--epochs", "1", "--batch-size", "32"]
FIRST_STEP_HOOK = Path(__file__).resolve().parent / "first_step"


def groups(job: str, only: set[str]) -> dict[str, dict[str, list[str]]]:
    ddprun = venv_command("ddprun", "ddprun")
    torchrun = venv_command("torchrun", "torch.distributed.run") + ["--standalone"]
    run = ddprun + ["run", "--cpu"]
    out = {
        "job2": {
            "torchrun --nproc-per-node 2": torchrun + ["--nproc-per-node", "2", job],
            "ddprun run --nproc 2 --fresh-start": run + ["--nproc", "2", "--fresh-start", job],
            "ddprun run --nproc 2 --warm-start": run + ["--nproc", "2", "--warm-start", job],
        },
        "job8": {
            "torchrun --nproc-per-node 8": torchrun + ["--nproc-per-node", "8", job],
            "ddprun run --nproc 8 --warm-start": run + ["--nproc", "8", "--warm-start", job],
        },
        "restart": {
            "torchrun --max-restarts 1": ["env", "MODE=restart", *torchrun, "--nproc-per-node", "2", "--max-restarts", "1", job],
            "ddprun run --max-restarts 1 --fresh-start": ["env", "MODE=restart", *run, "--max-restarts", "1", "--fresh-start", job],
            "ddprun run --max-restarts 1 --warm-start": ["env", "MODE=restart", *run, "--max-restarts", "1", "--warm-start", job],
        },
        "train": {
            "torchrun examples/train.py": torchrun + ["--nproc-per-node", "2", "examples/train.py", *TRAIN_STEP, "--samples", "64"],
            "ddprun train --fresh-start": ddprun + ["train", "--cpu", "--nproc", "2", "--fresh-start", "--model", "resnet18",
                                                    "--dataset-size", "64", "--image-size", "32", *TRAIN_STEP],
            "ddprun train --warm-start": ddprun + ["train", "--cpu", "--nproc", "2", "--warm-start", "--model", "resnet18",
                                                  "--dataset-size", "64", "--image-size", "32", *TRAIN_STEP],
        },
    }
    return {name: group for name, group in out.items() if name in only}


class Stamps:
    """After each run: the ranks' phases (job groups) or the restart's length (restart group)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: dict[str, list[dict[str, float]]] = {}

    def __call__(self, name: str, started: float, seconds: float, measured: bool) -> None:
        ranks = take_records(self.path)
        if not measured or not ranks:
            return
        first = [r for r in ranks if r["attempt"] == 0]
        again = [r for r in ranks if r["attempt"] == 1]
        row = {} if again else {
            "launcher start -> first rank starts": min(r["start"] for r in first) - started,
            "rank: import torch": statistics.mean(r["imported"] - r["start"] for r in first),
            "rank: gloo init, all-reduce": statistics.mean(r["done"] - r["imported"] for r in first),
            "last rank done -> launcher exits": started + seconds - max(r["done"] for r in ranks),
        }
        if again:
            died = next(r["done"] for r in first if r["rank"] == 1)
            row = {"rank 1 dies -> every rank has torch again": max(r["imported"] for r in again) - died,
                   "rank 1 dies -> every rank done again (the restart)": max(r["done"] for r in again) - died}
        self.rows.setdefault(name, []).append(row)

    def medians(self) -> dict[str, dict[str, float]]:
        return {name: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for name, rows in self.rows.items()}


class FirstSteps(Stamps):
    """After each run of the train group: when rank 0 and the last rank ended their first optimizer step."""

    def __call__(self, name: str, started: float, seconds: float, measured: bool) -> None:
        ranks = take_records(self.path)
        if not measured:
            return
        if len(ranks) < 2:
            raise SystemExit(f"{name}: {len(ranks)} first-step stamps, expected one per rank")
        self.rows.setdefault(name, []).append({
            "launcher start -> rank 0's first step": next(r["t"] for r in ranks if r["rank"] == 0) - started,
            "launcher start -> every rank's first step": max(r["t"] for r in ranks) - started,
            "launch to exit": seconds,
        })


def table(samples: dict[str, list[float]], metric: dict[str, float] | None = None) -> str:
    """Medians per command and each one's ratio to the group's first (torchrun), paired per round too."""
    names = list(samples)
    base = names[0]
    lines = ["| command | median s | min s | max s | ratio to torchrun | paired ratio |", "| --- | --- | --- | --- | --- | --- |"]
    for name in names:
        times = samples[name]
        ratio = statistics.median(times) / statistics.median(samples[base])
        paired = statistics.median(a / b for a, b in zip(times, samples[base]))
        lines.append(f"| `{name}` | {statistics.median(times):.3f} | {min(times):.3f} | {max(times):.3f} | "
                     f"{ratio:.3f} | {paired:.3f} |")
    return "\n".join(lines)


def phases_table(medians: dict[str, dict[str, float]]) -> str:
    names = list(medians)
    keys = list(medians[names[0]])
    lines = ["| median s | " + " | ".join(f"`{n}`" for n in names) + " |", "| --- |" + " --- |" * len(names)]
    lines += [f"| {key} | " + " | ".join(f"{medians[n][key]:.3f}" for n in names) + " |" for key in keys]
    if len(keys) in (2, 3):  # the restart, the first step: their own ratio
        key = keys[1]
        lines.append("| ratio to torchrun | " + " | ".join(f"{medians[n][key] / medians[names[0]][key]:.3f}" for n in names) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="measured rounds per group")
    parser.add_argument("--only", default="job2,job8,restart,train", help="groups to run")
    args = parser.parse_args()
    load_before, began = load_average(), time.perf_counter()
    report = {}
    with tempfile.TemporaryDirectory(prefix="bench_warm_") as scratch:
        job = Path(scratch, "job.py")
        job.write_text(JOB)
        env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        env.update(OMP_NUM_THREADS="1", STAMPS=os.path.join(scratch, "stamps.jsonl"), TMPDIR=scratch,
                   FIRST_STEP_STAMPS=os.path.join(scratch, "first_steps.jsonl"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(FIRST_STEP_HOOK), env.get("PYTHONPATH")])))
        for name, commands in groups(str(job), set(args.only.split(","))).items():
            stamps = FirstSteps(Path(env["FIRST_STEP_STAMPS"])) if name == "train" else Stamps(Path(env["STAMPS"]))
            # torchrun's restart reuses its store, where rank 0's address from the failed attempt stays:
            # the new attempt's gloo init now and then connects to it and fails. Run again, and counted.
            flaky = {command: 0 for command in commands if name == "restart" and command.startswith("torchrun")}
            samples = interleaved(commands, runs=args.runs, env=env, observe=stamps, cwd=ROOT, flaky=flaky)
            print(f"### {name}\n\n{table(samples)}\n")
            for command, failures in flaky.items():
                print(f"`{command}` failed {failures} time(s) in {args.runs + 1} rounds and was run again\n")
            if stamps.rows:
                print(phases_table(stamps.medians()) + "\n")
            report[name] = {"samples": samples, "stamps": stamps.medians()}
            sys.stdout.flush()
    print(f"- machine: {machine()}, torch {torch_version()}")
    print(f"- load average (1/5/15 min): {load_before} before, {load_average()} after; "
          f"{args.runs} rounds per group after 1 warm-up; {time.perf_counter() - began:.0f} s in all")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
