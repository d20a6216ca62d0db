"""The launcher's side of a hang: Ctrl-\\, the first Ctrl-C, a failed rank, and the stall watch.

All of it asks the ranks for their stacks through ddprun.stacks (a real-time signal each rank's
faulthandler answers); nothing runs while nobody asks, so a job without --stall-timeout runs as
before.

- Ctrl-\\ (SIGQUIT) prints every rank's grouped stacks; the job keeps running. torch >= 2.10 lets
  ddprun have SIGQUIT (the plan leaves it out of torch's signals); on an older torch, torch's own
  handler stops the job on SIGQUIT, and a terminal user is told so in one line.
- The first Ctrl-C prints where every rank was (each rank gets 2 s to answer) before the usual
  graceful stop; the second still kills at once (ddprun.signals' watcher thread). torch < 2.10
  installs its own SIGINT handler at each start of the workers, so there Ctrl-C shows no stacks
  (the same one-line note says so).
- When a rank fails (exits non-zero on its own, not from the stop signals), the ranks still alive
  are asked at once, inside the SIGCHLD handler: it runs in torch's agent thread, so torch cannot
  stop the others before they answered (1 s at most). If the failure is a collective timeout,
  the panel names the ranks that were not inside a collective, with their file:line. Without
  that sample, the stall watch's last one serves.
- Every rank's exit code is written to `attempt_N/rank_G.exit`, so `ddprun stacks` from another
  terminal can list a rank that exited with its code.
- --stall-timeout S: "no rank has advanced" means, for S seconds, all of: no rank wrote a byte to
  its stdout or stderr log, the bundled trainer's progress file did not grow, and every rank's
  stacks (sampled every S/4, between 0.5 and 30 s) stayed identical, with the same ranks alive.
  Then the grouped stacks are printed once, with the word "stalled"; the watch re-arms when
  anything advances. --on-stall kill then ends the job like a SIGTERM would, and ddprun exits 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.text import Text

from ddprun import report, stacks
from ddprun.deaths import Death, rank_of
from ddprun.envnames import PROGRESS_FILE_ENV
from ddprun.plan import LaunchPlan

_FAILURE_ANSWER_S = 1.0  # inside torch's agent thread: keep the delay of its stop short
_QUIET_EXITS = {0, -int(signal.SIGINT), -int(signal.SIGTERM), -int(signal.SIGKILL), 130, 143}


def sample_interval(timeout_s: float) -> float:
    """How often the stall watch samples: four samples per timeout, within 0.5-30 s."""
    return min(max(timeout_s / 4, 0.5), 30.0)


@dataclass
class StallClock:
    """Decides, from successive progress marks, when a job has stalled (once per stall)."""

    timeout_s: float
    mark: Any = None
    since: float = 0.0
    reported: bool = False
    samples: int = 0  # identical samples in a row

    def observe(self, mark: Any, now: float) -> float | None:
        """Seconds without progress when this observation completes a stall; None otherwise."""
        if mark != self.mark or self.mark is None:
            self.mark, self.since, self.reported, self.samples = mark, now, False, 1
            return None
        self.samples += 1
        if self.reported or now - self.since < self.timeout_s:
            return None
        self.reported = True
        return now - self.since


def progress_mark(attempt_dir: Path, *, progress_path: str, snapshot: Sequence[stacks.RankStacks]) -> tuple:
    """Everything whose change means some rank advanced: output sizes, progress, stacks."""
    sizes = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(attempt_dir)):
            if name.endswith((".stdout.log", ".stderr.log")):
                sizes.append((name, _size(attempt_dir / name)))
    return (str(attempt_dir), tuple(sizes), _size(Path(progress_path)), stacks.signature(snapshot))


def trainer_line(progress_path: str, *, now: float) -> str | None:
    """From the bundled trainer's progress file: rank 0's last recorded step and its age."""
    try:
        with open(progress_path, "rb") as stream:
            stream.seek(max(0, stream.seek(0, os.SEEK_END) - 4096))
            last = stream.read().decode(errors="replace").strip().splitlines()[-1]
        record = json.loads(last)
        age = now - os.stat(progress_path).st_mtime
        return f"rank 0 has not recorded a step after step {int(record['step'])} for {age:.0f} s"
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


class HangWatch:
    """Around the launch: SIGQUIT, the stall watch, and the per-death hook (see the module doc)."""

    def __init__(self, plan: LaunchPlan, *, console: Console, say: Callable[[str], None],
                 attempt: Callable[[], Any]) -> None:
        self.plan, self.console, self.say, self._attempt = plan, console, say, attempt
        self.progress_path = os.path.join(plan.log_dir, "progress.jsonl")
        self.ended_stalled = False  # --on-stall kill stopped the job
        self._stopping = False
        self._print_lock = threading.Lock()
        self._failure_samples: dict[str, list[stacks.RankStacks]] = {}
        self._last_sample: tuple[str, list[stacks.RankStacks]] | None = None
        self._done = threading.Event()
        self._threads: list[threading.Thread] = []
        self._previous_quit: Any = None

    # --- entering and leaving ---

    def __enter__(self) -> "HangWatch":
        if self.plan.launch.stacks_on_sigquit:
            self._previous_quit = signal.signal(signal.SIGQUIT, self._on_sigquit)
        elif sys.stdin is not None and sys.stdin.isatty():
            self.say(f"note: torch {self.plan.launch.torch_version} (< 2.10) takes Ctrl-\\ and Ctrl-C itself: Ctrl-\\ "
                     "stops the job and Ctrl-C shows no stacks; `ddprun stacks` in another terminal shows where the ranks are.")
        self._make_flight_recorder_folder()
        if self.plan.stall_timeout_s:
            os.environ[PROGRESS_FILE_ENV] = self.progress_path  # the trainer's records count as progress
            self._start(self._watch_stalls, name="ddprun-stall-watch")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping = True
        self._done.set()
        if self._previous_quit is not None:
            signal.signal(signal.SIGQUIT, self._previous_quit)
        for thread in self._threads:
            thread.join(timeout=3)

    def _start(self, target: Callable[[], None], *, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _make_flight_recorder_folder(self) -> None:
        prefix = self.plan.env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "")
        folder = os.path.dirname(prefix)
        if prefix.startswith(self.plan.log_dir + os.sep) and not os.path.isdir(folder):
            with contextlib.suppress(OSError):
                os.mkdir(folder, 0o700)

    # --- asking and printing ---

    def _snapshot(self, *, timeout_s: float = stacks.ANSWER_TIMEOUT_S) -> tuple[Any, list[stacks.RankStacks]]:
        attempt = self._attempt()
        if attempt is None:
            return None, []
        return attempt, stacks.collect(attempt.directory, timeout_s=timeout_s)

    def _print(self, snapshot: Sequence[stacks.RankStacks], *, title: str, details: bool = True,
               extra: Sequence[str] = ()) -> None:
        with self._print_lock:
            self.console.print(Text(f"ddprun: {title}", style="bold yellow"))
            for line in extra:
                self.console.print(Text(f"  {line}"))
            if snapshot:
                self.console.print(stacks.render(snapshot, details=details))
            else:
                self.console.print(Text("  no worker has started yet"))

    def _on_sigquit(self, _signum: int, _frame: object) -> None:
        if not any(t.name == "ddprun-stacks" and t.is_alive() for t in self._threads):
            self._start(self._show_stacks, name="ddprun-stacks")

    def _show_stacks(self) -> None:
        _, snapshot = self._snapshot()
        self._print(snapshot, title="every rank's stacks (Ctrl-\\; the job keeps running):")

    def show_interrupted(self) -> None:
        """The first Ctrl-C: where every rank was, bounded to about 2 s, before the graceful stop."""
        self._stopping = True
        try:
            attempt, snapshot = self._snapshot()
            where = f"full stacks: {attempt.directory}/rank_<G>.stacks" if attempt else ""
            self._print(snapshot, title="interrupted; where every rank was:", details=False, extra=())
            if where:
                self.console.print(Text(f"  {where}", style="dim", no_wrap=True, overflow="ignore"))
        except Exception as error:  # never stand between Ctrl-C and the stop
            self.say(f"could not read the ranks' stacks: {error}")

    # --- deaths (called in the SIGCHLD handler, in torch's agent thread) ---

    def on_death(self, death: Death) -> None:
        try:
            self._record_death(death)
        except Exception:  # never raise into torch's agent from a signal handler
            pass

    def _record_death(self, death: Death) -> None:
        attempt = self._attempt()
        if attempt is None:
            return
        rank = rank_of(death.pid, attempt.directory)
        if rank is None:
            return
        stacks.write_exit_record(attempt.directory, rank, death.exitcode)
        key = str(attempt.directory)
        if death.exitcode in _QUIET_EXITS or self._stopping or key in self._failure_samples:
            return
        self._failure_samples[key] = []  # one sample per attempt, even if this one raises
        self._failure_samples[key] = stacks.collect(attempt.directory, timeout_s=_FAILURE_ANSWER_S)

    # --- the failure panel ---

    def failure_notes(self, failures: Sequence[report.RankFailure]) -> list[Text]:
        """Lines for the failure panel: the likely culprit of a collective timeout, NCCL dumps."""
        lines: list[str] = []
        cause = report.root_cause(failures)
        if stacks.looks_like_collective_timeout(f"{cause.exc_type}: {cause.exc_message}"):
            lines += stacks.culprit_lines(self._sample_for_failure(), failed_rank=cause.rank)
        prefix = self.plan.env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
        if prefix:
            lines += stacks.flight_record_lines(stacks.flight_records(prefix), folder=os.path.dirname(prefix))
        return [Text(line, style="bold" if line.startswith("Likely cause") else "") for line in lines]

    def _sample_for_failure(self) -> list[stacks.RankStacks]:
        attempt = self._attempt()
        key = str(attempt.directory) if attempt else ""
        if self._failure_samples.get(key):
            return self._failure_samples[key]
        if self._last_sample and self._last_sample[0] == key:
            return self._last_sample[1]
        return []

    # --- the stall watch ---

    def _watch_stalls(self) -> None:
        timeout_s = float(self.plan.stall_timeout_s or 0)
        interval = sample_interval(timeout_s)
        clock = StallClock(timeout_s)
        while not self._done.wait(interval):
            attempt, snapshot = self._snapshot(timeout_s=min(stacks.ANSWER_TIMEOUT_S, interval))
            if attempt is None or self._stopping:
                continue
            self._last_sample = (str(attempt.directory), snapshot)
            mark = progress_mark(attempt.directory, progress_path=self.progress_path, snapshot=snapshot)
            stalled_for = clock.observe(mark, time.monotonic())
            if stalled_for is not None:
                self._report_stall(snapshot, stalled_for=stalled_for, samples=clock.samples)

    def _report_stall(self, snapshot: Sequence[stacks.RankStacks], *, stalled_for: float, samples: int) -> None:
        trainer = trainer_line(self.progress_path, now=time.time())
        self._print(snapshot, title=f"stalled: no rank has advanced for {stalled_for:.0f} s (no new output, "
                    f"no progress record, the same stacks in {samples} samples)", extra=[trainer] if trainer else [])
        if self.plan.on_stall == "kill":
            self.say("ending the stalled job (--on-stall kill).")
            self.ended_stalled = True
            self._stopping = True
            os.kill(os.getpid(), signal.SIGTERM)  # the graceful stop, as for a scheduler's SIGTERM
        else:
            self.say("still waiting; the stacks are printed again if it stalls again after moving on "
                     "(--on-stall kill ends a stalled job).")
