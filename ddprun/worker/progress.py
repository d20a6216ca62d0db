"""What rank 0 shows on stderr: a Rich bar in a terminal, plain periodic lines otherwise, a summary table."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ddprun.envnames import PROGRESS_FILE_ENV


@dataclass(frozen=True)
class RunSummary:
    """The figures a finished run reports; also the --metrics-json document."""

    world_size: int
    global_batch_size: int
    batch_size_per_process: int
    steps: int  # optimizer steps in total, including those before a resume
    epochs: int  # epochs completed
    samples_per_sec: Optional[float]  # global, steady state (first steps of the run excluded)
    samples_per_sec_per_process: Optional[float]
    cpu_seconds_per_step: Optional[float]  # rank 0's process CPU time per measured step (all threads)
    wall_time_s: float
    final_loss: Optional[float]  # mean training loss of the last epoch run, over all ranks
    val_accuracy: Optional[float]  # None without a validation set
    val_samples: int  # validation images counted over all ranks (each exactly once)
    peak_memory_bytes: int  # largest over ranks: CUDA allocated, or CPU resident set
    peak_memory_kind: str  # "cuda" | "rss"
    model: str
    device: str
    grad_allreduce: str  # "shm" (shared memory), or the backend that all-reduced: "gloo" | "nccl"
    resumed_from_step: Optional[int]
    best_val_accuracy: Optional[float] = None  # best over the epochs (best.pt holds those weights)
    first_step_loss: Optional[float] = None  # rank 0's training loss at step 1, when this run trained it
    last_step_loss: Optional[float] = None  # rank 0's training loss at the last step
    # One record per epoch run: {"epoch", "step", "loss" (mean over ranks), "val_accuracy", "lr" (at its end)}
    history: tuple = ()


def write_metrics(summary: RunSummary, path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(dataclasses.asdict(summary), handle, indent=2)
        handle.write("\n")


def _format_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Reporter:
    """Rank 0's progress. `step` is cheap: the loss is read (a device sync) only when shown."""

    def __init__(self, *, total_steps: int, start_step: int, epochs: int, global_batch: int,
                 log_interval: float, stream: Optional[TextIO] = None) -> None:
        stream = sys.stderr if stream is None else stream
        self._total, self._start, self._epochs = total_steps, start_step, epochs
        self._global_batch = global_batch
        self._interval = log_interval
        self._stream = stream
        self._console = Console(file=stream, stderr=stream is sys.stderr)
        self._began = time.perf_counter()
        self._last_shown = self._began
        self._epoch: Optional[int] = None
        self._bar = self._make_bar() if self._console.is_terminal else None
        # Under ddprun in a terminal, the launcher draws the bar from these records.
        self._feed_path = os.environ.get(PROGRESS_FILE_ENV)
        self._last_fed = self._began

    def _make_bar(self):
        bar = Progress(
            TextColumn("epoch {task.fields[epoch]}"), BarColumn(),
            TextColumn("step {task.completed}/{task.total}"), TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[speed]} samples/s"), TimeRemainingColumn(),
            console=self._console, transient=False,
        )
        bar.start()
        self._task = bar.add_task("train", total=self._total, completed=self._start,
                                  epoch="-", loss="-", speed="-")
        return bar

    def start_epoch(self, epoch: int) -> None:
        if self._epoch is None:  # speed and ETA count from the first step, not from setup
            self._began = self._last_shown = time.perf_counter()
        self._epoch = epoch
        if self._bar is not None:
            self._bar.update(self._task, epoch=f"{epoch + 1}/{self._epochs}")

    def step(self, step: int, loss: Callable[[], float]) -> None:
        now = time.perf_counter()
        if self._feed_path and now - self._last_fed >= 0.5:
            self._last_fed = now
            self._feed(step, loss(), now)
        if self._bar is not None:
            self._bar.update(self._task, completed=step)
            if now - self._last_shown >= 0.5:
                self._last_shown = now
                self._bar.update(self._task, loss=f"{loss():.4f}", speed=f"{self._speed(step, now):,.0f}")
        elif now - self._last_shown >= self._interval:
            self._last_shown = now
            self._line(step, loss(), now)

    def _feed(self, step: int, loss: float, now: float) -> None:
        record = {"epoch": f"{(self._epoch or 0) + 1}/{self._epochs}", "step": step, "total": self._total,
                  "loss": loss, "speed": self._speed(step, now)}
        try:
            with open(self._feed_path, "a") as feed:
                feed.write(json.dumps(record) + "\n")
        except OSError:
            self._feed_path = None  # the bar is a nicety: never fail training for it

    def _speed(self, step: int, now: float) -> float:
        return (step - self._start) * self._global_batch / max(now - self._began, 1e-9)

    def _line(self, step: int, loss: float, now: float) -> None:
        per_step = (now - self._began) / max(step - self._start, 1)
        eta = _format_eta(per_step * (self._total - step))
        print(f"epoch {(self._epoch or 0) + 1}/{self._epochs} step {step}/{self._total} loss {loss:.4f} "
              f"{self._speed(step, now):,.1f} samples/s eta {eta}", file=self._stream, flush=True)

    def end_epoch(self, epoch: int, *, loss: Optional[float], val_accuracy: Optional[float],
                  stopped_at: Optional[int] = None, lr: Optional[float] = None) -> None:
        done = "done" if stopped_at is None else f"stopped at step {stopped_at} (--max-steps)"
        parts = [f"epoch {epoch + 1}/{self._epochs} {done}"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if val_accuracy is not None:
            parts.append(f"val accuracy {val_accuracy:.2%}")
        if lr is not None:
            parts.append(f"lr {lr:.3g}")
        self.note(", ".join(parts))

    def note(self, message: str) -> None:
        if self._bar is not None:
            self._bar.console.print(message, highlight=False, markup=False)
        else:
            print(message, file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def summary(self, summary: RunSummary) -> None:
        self.close()
        self._console.print(summary_table(summary))


class NullReporter:
    """Every rank but 0: silent."""

    def start_epoch(self, epoch: int) -> None: ...
    def step(self, step: int, loss: Callable[[], float]) -> None: ...
    def end_epoch(self, epoch: int, *, loss: Optional[float], val_accuracy: Optional[float],
                  stopped_at: Optional[int] = None, lr: Optional[float] = None) -> None: ...
    def note(self, message: str) -> None: ...
    def close(self) -> None: ...
    def summary(self, summary: RunSummary) -> None: ...


def _fmt(value: Optional[float], spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def summary_table(s: RunSummary) -> Table:
    table = Table(title=f"ddprun train: {s.model} on {s.world_size} x {s.device}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    memory = "GPU memory (peak, max over ranks)" if s.peak_memory_kind == "cuda" else "resident memory (peak, max)"
    accumulated = s.global_batch_size != s.world_size * s.batch_size_per_process
    batch = f"{s.global_batch_size} ({s.world_size} x {s.batch_size_per_process}{' x accumulation' * accumulated})"
    rows = [
        ("epochs", str(s.epochs)), ("steps", str(s.steps)), ("global batch", batch),
        ("samples/s (global)", _fmt(s.samples_per_sec, ",.1f")),
        ("samples/s (per process)", _fmt(s.samples_per_sec_per_process, ",.1f")),
        ("wall time", f"{s.wall_time_s:.1f} s"), ("final loss", _fmt(s.final_loss, ".4f")),
        ("val accuracy", _fmt(s.val_accuracy, ".2%", "no val set")),
        (memory, f"{s.peak_memory_bytes / 2**20:,.0f} MiB"),
        ("gradient all-reduce", "shared memory" if s.grad_allreduce == "shm" else s.grad_allreduce),
    ]
    if s.best_val_accuracy is not None:
        rows.append(("best val accuracy", _fmt(s.best_val_accuracy, ".2%")))
    if s.resumed_from_step is not None:
        rows.append(("resumed from step", str(s.resumed_from_step)))
    for name, value in rows:
        table.add_row(name, value)
    return table
