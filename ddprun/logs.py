"""Where each rank's output goes: files named after the global rank, and a prefixed console copy.

torch elastic asks a `LogsSpecs` for every (re)start of the workers, passing each local
rank's environment (which holds its global RANK). Every rank's stdout and stderr always go
to files under `<log_dir>/attempt_<n>/`, created fresh and private (0700 folder, 0600 files)
inside the job's own folder (see runfolders); the console gets the ranks the user asked for,
one whole line at a time, prefixed with `[rank G]` by torch's tailer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from ddprun import runfolders, torch_internals, torchrun_compat
from ddprun.envnames import ERROR_FILE_ENV, PID_FILE_ENV, STACKS_FILE_ENV

from ddprun.plan import LINE_PREFIX_TEMPLATE, ConsoleChoices  # noqa: E402,F401  (re-exported)


def _terminal(fd: int) -> str | None:
    """The launcher's terminal device behind fd 1 or 2 (e.g. /dev/pts/3), or None off a terminal."""
    try:
        return os.ttyname(fd) if os.isatty(fd) else None
    except OSError:
        return None


@dataclass
class Attempt:
    """What one start of the workers wrote where, by global rank."""

    number: int
    directory: Path
    started_at: float = field(default_factory=time.monotonic)
    global_ranks: dict[int, int] = field(default_factory=dict)  # local rank -> global rank

    def stderr_log(self, rank: int) -> Path:
        return self.directory / f"rank_{rank}.stderr.log"

    def stdout_log(self, rank: int) -> Path:
        return self.directory / f"rank_{rank}.stdout.log"

    def error_file(self, rank: int) -> Path:
        return self.directory / f"rank_{rank}.error.json"

    def pid_file(self, rank: int) -> Path:
        return self.directory / f"rank_{rank}.pid"

    def stacks_file(self, rank: int) -> Path:  # the rank's faulthandler dumps (ddprun.stacks)
        return self.directory / f"rank_{rank}.stacks"


class RankLogsSpecs(LogsSpecs):
    """torch calls `reify` at every (re)start of the workers with their environments: the one
    per-attempt hook it offers, so `on_attempt(number, envs)` may adjust those too."""

    def __init__(
        self, log_dir: str, *, console_ranks: set[int] | None,
        on_attempt: Callable[[int, dict[int, dict[str, str]]], None] = lambda number, envs: None,
        console: ConsoleChoices | None = None,
    ) -> None:
        super().__init__(log_dir=log_dir)
        self._log_dir = log_dir  # ours: torch keeps its copy in a private attribute
        self._console_ranks = console_ranks
        self._console = console or ConsoleChoices()
        self._on_attempt = on_attempt
        self.attempts: list[Attempt] = []

    @property
    def root_log_dir(self) -> str:
        return str(self._log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        number = int(next(iter(envs.values()), {}).get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._on_attempt(number, envs)
        attempt = Attempt(number, Path(self.root_log_dir) / self._folder_name(number))
        runfolders.make_private_dir(str(attempt.directory))  # new, inside the job's own new folder
        dest = LogsDest()
        for local_rank, env in envs.items():
            rank = int(env["RANK"])
            attempt.global_ranks[local_rank] = rank
            dest.stdouts[local_rank] = str(attempt.stdout_log(rank))
            dest.stderrs[local_rank] = str(attempt.stderr_log(rank))
            dest.error_files[local_rank] = str(attempt.error_file(rank))
            # torch opens stdout/stderr itself with "w", which keeps the mode of an existing file.
            # Error files are not made ahead: torch reads any error file it finds as JSON.
            for path in (attempt.stdout_log(rank), attempt.stderr_log(rank), attempt.pid_file(rank)):
                runfolders.make_private_file(str(path))
            env[ERROR_FILE_ENV] = dest.error_files[local_rank]
            env[PID_FILE_ENV] = str(attempt.pid_file(rank))
            env[STACKS_FILE_ENV] = str(attempt.stacks_file(rank))
            self._route(dest, local_rank=local_rank, rank=rank)
        torch_internals.tune_logs_dest(dest)
        self.attempts.append(attempt)
        return dest

    def _route(self, dest: LogsDest, *, local_rank: int, rank: int) -> None:
        """The console rank in a terminal writes to the terminal itself (torch opens the path we
        give; stdin is inherited): tqdm, colours and breakpoint() work, and its log files stay
        empty. Any other shown stream is copied, prefixed, from its file to the console."""
        shown = self._console_ranks is None or rank in self._console_ranks
        local = self._console.local_ranks
        shown = shown and (local is None or local_rank in local)
        for stream, files, tees in ((1, dest.stdouts, dest.tee_stdouts), (2, dest.stderrs, dest.tee_stderrs)):
            terminal = _terminal(stream) if rank == self._console.tty_rank else None
            if terminal:
                files[local_rank] = terminal
            elif shown and torchrun_compat.stream_shown(redirects=self._console.redirects, tee=self._console.tee,
                                                        local_rank=local_rank, stream=stream):
                tees[local_rank] = files[local_rank]

    def _folder_name(self, number: int) -> str:
        # An elastic membership change restarts the workers without counting a restart, so a
        # number can come again; each start still gets a folder of its own.
        again = sum(1 for a in self.attempts if a.number == number)
        return f"attempt_{number}" + (f".{again + 1}" if again else "")

    @property
    def current(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None
