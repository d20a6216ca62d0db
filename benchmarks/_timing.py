"""Timing helpers shared by the benchmarks: wall time of a fresh process, interleaved rounds, medians.

Commands being compared run in turns (A B A B ...), so a busy or cold machine slows each alike.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

# Called after every run, warm-up included: (name, epoch time at spawn, seconds, measured?).
Observer = Callable[[str, float, float, bool], None]

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Stats:
    median: float
    min: float
    max: float
    runs: int


def stats(samples: Sequence[float]) -> Stats:
    return Stats(statistics.median(samples), min(samples), max(samples), len(samples))


def wall_time(argv: Sequence[str], *, cwd: Path = ROOT, env: Optional[Mapping[str, str]] = None) -> tuple[float, int]:
    """Seconds from spawning `argv` to its exit, and its exit code. Output is discarded."""
    seconds, code, _ = _timed_run(argv, cwd=cwd, env=env, stderr=subprocess.DEVNULL)
    return seconds, code


def _timed_run(argv: Sequence[str], *, cwd: Path, env: Optional[Mapping[str, str]], stderr) -> tuple[float, int, str]:
    started = time.perf_counter()
    done = subprocess.run(
        list(argv), cwd=cwd, env=None if env is None else dict(env),
        stdout=subprocess.DEVNULL, stderr=stderr, check=False,
    )
    return time.perf_counter() - started, done.returncode, (done.stderr or b"").decode(errors="replace")


def interleaved(
    commands: Mapping[str, Sequence[str]], *, runs: int, warmup: int = 1,
    cwd: Path = ROOT, env: Optional[Mapping[str, str]] = None, observe: Optional[Observer] = None,
    flaky: Optional[dict[str, int]] = None,
) -> dict[str, list[float]]:
    """Run every command once per round, in the given order, for `warmup` discarded rounds
    and then `runs` measured ones. A non-zero exit stops the benchmark: a failing command's
    time means nothing. `flaky`: commands known to fail now and then (torchrun's restart), each
    run again up to 3 times; the count of their failures is kept there for the report."""
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for round_number in range(warmup + runs):
        for name, argv in commands.items():
            started = time.time()
            # stderr is kept (through a pipe, for every command alike) to explain a failure.
            seconds, code, err = _timed_run(argv, cwd=cwd, env=env, stderr=subprocess.PIPE)
            for _ in range(3 if flaky is not None and name in flaky else 0):
                if code == 0:
                    break
                flaky[name] += 1
                if observe is not None:
                    observe(name, started, seconds, False)  # its partial records are dropped
                started = time.time()
                seconds, code, err = _timed_run(argv, cwd=cwd, env=env, stderr=subprocess.PIPE)
            if code != 0:
                tail = "\n".join(err.splitlines()[-20:])
                raise SystemExit(f"{name} exited with code {code}: {' '.join(argv)}\n{tail}")
            measured = round_number >= warmup
            if measured:
                samples[name].append(seconds)
            if observe is not None:
                observe(name, started, seconds, measured)
    return samples


def take_records(path: Path) -> list[dict]:
    """The JSON lines the ranks of one run appended to `path`, which is then removed for the next run."""
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    path.unlink(missing_ok=True)
    return records


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def torch_version() -> str:
    """Read from the installed package metadata: importing torch here would cost seconds."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "not installed"


def venv_command(name: str, *fallback_module: str) -> list[str]:
    """The console script `name` next to this Python, else `python -m <fallback_module>`."""
    script = Path(sys.executable).parent / name
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", *fallback_module]
