"""The launcher process of a job started from Python: carries out the plan ddprun.api wrote.

    python -m ddprun.jobprocess JOB_FOLDER CALLER_PID

ddprun.api built the plan (the CLI's own planner) and made the job folder; this process does
what the CLI's process does after that: `launch.execute(plan)`, with the held store, the
subreaper and watchdog, signals, restarts and per-rank logs. What the caller cannot see from
an exit code it finds in the job folder (0600 files, read and removed by ddprun.api):
`failure.pkl` (the failed ranks and the panel's plain text) or `error.json` (a DdprunError:
message, hint, exit code).

The caller's death stops the job: the kernel sends this process SIGTERM (PR_SET_PDEATHSIG),
which stops the workers as a SIGTERM to the CLI does.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import pickle
import signal
import sys

from rich.console import Console

from ddprun.errors import DdprunError

PLAN_FILE = "plan.pkl"
FAILURE_FILE = "failure.pkl"
ERROR_FILE = "error.json"
PANEL_WIDTH = 100
_PR_SET_PDEATHSIG = 1


def stop_with_caller(caller_pid: int) -> None:
    """SIGTERM (a graceful stop) when the caller dies; at once if it is gone already."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != caller_pid:
        raise SystemExit(128 + signal.SIGTERM)


def write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def plain_text(renderable: object) -> str:
    """A Rich renderable as plain text, the way a terminal of PANEL_WIDTH columns shows it."""
    buffer = io.StringIO()
    Console(file=buffer, width=PANEL_WIDTH, color_system=None, force_terminal=False,
            highlight=False).print(renderable)
    return buffer.getvalue().rstrip("\n")


def run(folder: str) -> int:
    from ddprun import panels, warmstart

    with open(os.path.join(folder, PLAN_FILE), "rb") as source:
        plan = pickle.load(source)
    console = Console(stderr=True, highlight=False)
    warm = warmstart.start(plan, environ=os.environ, say=panels.sayer(console))  # importing while we do
    from ddprun import launch

    def on_failure(failures: list, panel: object) -> None:
        record = {"failures": failures, "panel": plain_text(panel)}
        write_private(os.path.join(folder, FAILURE_FILE), pickle.dumps(record))

    try:
        return launch.execute(plan, console=console, warm=warm, announce=lambda: console.print(panels.render_plan(plan)),
                          on_failure=on_failure)
    except DdprunError as error:
        record = {"message": error.message, "hint": error.hint, "exit_code": error.exit_code}
        write_private(os.path.join(folder, ERROR_FILE), json.dumps(record).encode())
        return error.exit_code


def main(argv: list[str]) -> None:
    folder, caller = argv[0], int(argv[1])
    try:
        stop_with_caller(caller)
        code = run(folder)
    except KeyboardInterrupt:  # a stop that came before ddprun's own handlers were in place
        code = 128 + signal.SIGINT
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the CLI: nothing left to tear down in an interpreter that imported torch


if __name__ == "__main__":
    main(sys.argv[1:])
