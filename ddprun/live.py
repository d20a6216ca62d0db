"""A live progress bar in the launcher's terminal, fed by rank 0 of the bundled trainer.

Workers write to log files, never to a terminal, so a bar drawn by a worker could not
work. Instead rank 0 appends small JSON records to DDPRUN_PROGRESS_FILE and the launcher,
which owns the terminal, draws the bar below the ranks' lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from ddprun.envnames import PROGRESS_FILE_ENV

_POLL_S = 0.25


@contextlib.contextmanager
def progress_bar(console: Console, *, path: str) -> Iterator[None]:
    """Draw the bar while the job runs, when both stdout and stderr are a terminal, from the first
    record on: a job that sends none (any script but the trainer) never gets a live display that
    would clear the line the console rank is writing to the terminal."""
    if not (console.is_terminal and sys.stdout.isatty()):
        yield
        return
    os.environ[PROGRESS_FILE_ENV] = path
    bar = Progress(
        TextColumn("epoch {task.fields[epoch]}"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]} samples/s"), TimeRemainingColumn(),
        console=console, transient=True, redirect_stdout=True, redirect_stderr=True,
    )
    done = threading.Event()
    follower = threading.Thread(target=_follow, args=(path, bar, done), name="ddprun-progress", daemon=True)
    follower.start()
    try:
        yield
    finally:
        done.set()
        follower.join(timeout=1)
        if bar.live.is_started:
            bar.stop()


def _follow(path: str, bar: Progress, done: threading.Event) -> None:
    task = None
    offset = 0
    while not done.wait(_POLL_S):
        try:
            with open(path, "rb") as stream:
                stream.seek(offset)
                data = stream.read()
        except FileNotFoundError:
            continue
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits
        offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            record = _parse(line)
            if record is None:
                continue
            if task is None:
                bar.start()
                task = bar.add_task("train", total=record["total"], epoch="-", loss="-", speed="-")
            bar.update(task, completed=record["step"], total=record["total"], epoch=record["epoch"],
                       loss=f"{record['loss']:.4f}", speed=f"{record['speed']:,.0f}")


def _parse(line: str) -> dict | None:
    try:
        record = json.loads(line)
        return record if {"step", "total", "epoch", "loss", "speed"} <= record.keys() else None
    except ValueError:
        return None
