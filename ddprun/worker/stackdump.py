"""Each rank answers "where are you?" without disturbing the user's code.

`install()` (called by the bootstrap before the user's code runs) registers
`faulthandler.register(SIGRTMIN + STACKS_SIGNAL_OFFSET, file=<rank's stacks file>, all_threads=True)`.
Nothing runs until someone asks: no thread, no timer, no Python-level signal handler. When the
launcher (or `ddprun stacks`) sends that signal, faulthandler's C handler appends every Python
thread's stack to the file, in its own format:

    Thread 0x00007f... (most recent call first):
      File "/path/train.py", line 88 in step
      ...

    Current thread 0x00007f... (most recent call first):
      File ...

It needs no GIL, so a rank blocked in C (a collective, a sleep, a lock) still answers.

Why a real-time signal and chain=False: the user's own SIGUSR1/SIGUSR2/SIGQUIT handlers stay
untouched because ddprun never uses those signals. faulthandler's chain=True would, after the dump,
run the previous handler, which for an unused real-time signal is the default action: terminate
the process. So the dump does not chain; no one else uses this signal.

The asker only signals a process whose /proc/<pid>/status shows the signal caught, so a rank
that has not got here yet (or exec'd another program) is never killed by the question.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from typing import IO

from ddprun.envnames import STACKS_FILE_ENV, STACKS_SIGNAL_OFFSET

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
_open_files: list[IO[str]] = []  # faulthandler writes to the fd: the file must stay open


def stacks_signal() -> int:
    return int(signal.SIGRTMIN) + STACKS_SIGNAL_OFFSET


def install() -> None:
    """Register the dump on this rank's stacks file; without the variable (not under ddprun), nothing."""
    path = os.environ.get(STACKS_FILE_ENV)
    if not path or not hasattr(signal, "SIGRTMIN"):
        return
    try:
        fd = os.open(path, _FLAGS, 0o600)
        stream = os.fdopen(fd, "a")
        faulthandler.register(stacks_signal(), file=stream, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        return  # the launcher then reports this rank as not answering; the job runs on
    _open_files.append(stream)
