"""Which worker died first, and how: observed as it happens, without taking the exit status from torch.

torch's own account of a failed attempt ranks failures by whole-second timestamps, so the
rank it names is often one it stopped itself. Here a SIGCHLD handler looks at each dead
child with waitid(WNOWAIT), which reads the status and leaves the child for torch to reap.
Each worker's bootstrap writes its pid to a file named after its global rank, which maps the
pid back to the rank.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ddprun import proc
from ddprun.envnames import CLIENT_PID_SUFFIX

@dataclass(frozen=True)
class Death:
    pid: int
    exitcode: int  # negative: killed by that signal, as subprocess reports it
    at: float


class DeathWatch:
    def __init__(self) -> None:
        self.deaths: list[Death] = []
        self._seen: set[int] = set()
        self._previous: Callable | int | None = None
        self.on_death: Callable[[Death], None] | None = None  # called in the handler, once per child

    def __enter__(self) -> "DeathWatch":
        self._previous = signal.signal(signal.SIGCHLD, self._on_sigchld)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGCHLD, self._previous)

    def _on_sigchld(self, _signum: int, _frame: object) -> None:
        for pid in proc.zombie_children():
            if pid in self._seen:
                continue
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                continue
            if info is None:
                continue
            self._seen.add(pid)
            code = -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status
            self.deaths.append(Death(pid, code, time.monotonic()))
            if self.on_death is not None:
                self.on_death(self.deaths[-1])

    def first_failure_since(self, moment: float) -> Death | None:
        return next((d for d in self.deaths if d.at >= moment and d.exitcode != 0), None)


def rank_of(pid: int, attempt_dir: Path) -> int | None:
    """The global rank whose bootstrap wrote `pid` into attempt_dir/rank_G.pid, or (warm start) whose
    client, the process torch started for it, wrote it into rank_G.pid.client."""
    for path in [*attempt_dir.glob("rank_*.pid"), *attempt_dir.glob(f"rank_*.pid{CLIENT_PID_SUFFIX}")]:
        try:
            if int(path.read_text()) == pid:
                return int(path.name[len("rank_"):].split(".", 1)[0])
        except (OSError, ValueError):
            continue
    return None
