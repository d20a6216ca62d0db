"""Signals while a job runs: a graceful stop, a hard stop, and forwarding preemption notices."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable, Iterator, Sequence

from ddprun import proc, reaper

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def handling(*, forward: Sequence[str], graceful_stop: Callable[[signal.Signals], None],
             workers_started: Callable[[], bool], say: Callable[[str], None]) -> Iterator[None]:
    """First SIGINT/SIGTERM: `graceful_stop(sig)` in the main thread (it raises into the
    launcher, which stops the workers with that signal, waits the grace period, then kills).
    A second one, or one before any worker started: SIGKILL the workers and everything they
    started (ddprun.reaper), and exit at once.

    Python runs signal handlers only when the main thread is back in Python code, and torch's
    rendezvous can block it inside C++ for minutes. The signal's wakeup byte reaches a watcher
    thread at once, so the hard stop never waits for the main thread.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(
        target=_watch, args=(read_fd,), kwargs={"workers_started": workers_started, "say": say},
        name="ddprun-signals", daemon=True,
    )
    watcher.start()

    def stop(signum: int, _frame: object) -> None:
        graceful_stop(signal.Signals(signum))

    def relay(signum: int, _frame: object) -> None:
        kill_children(signal.Signals(signum))

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    for name in forward:
        sig = getattr(signal, name)
        previous[sig] = signal.signal(sig, relay)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)  # ends the watcher


def _watch(read_fd: int, *, workers_started: Callable[[], bool], say: Callable[[str], None]) -> None:
    stops: list[signal.Signals] = []
    while chunk := os.read(read_fd, 64):
        stops += [signal.Signals(b) for b in chunk if b in STOP_SIGNALS]
        if not stops:
            continue
        if len(stops) >= 2:
            say(f"{stops[-1].name} again: killed the workers.")
        elif workers_started():
            continue  # the main thread stops them gracefully
        else:
            say(f"stopped by {stops[0].name} before any worker started.")
        reaper.kill_descendants(signal.SIGKILL)  # workers and whatever they started
        os._exit(128 + int(stops[0]))
    os.close(read_fd)


def kill_children(sig: signal.Signals) -> None:
    """Signal this process's direct children: the workers, each in its own session."""
    for pid in proc.children():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
