"""What torchrun starts in every rank: guard against orphaning, then run the user's code as __main__.

Usage: python -m ddprun.worker.bootstrap SCRIPT [ARGS...]
       python -m ddprun.worker.bootstrap -m MODULE [ARGS...]

An uncaught exception is written to torch elastic's error file (TORCHELASTIC_ERROR_FILE) in the
format `torch.distributed.elastic.multiprocessing.errors.record` writes, so no user script needs
decorating. torch is not imported here: a script that never imports torch starts fast.

Before the user's code runs, worker/stackdump.py registers faulthandler on a real-time signal,
so `ddprun stacks`, Ctrl-\\ and the stall watch can ask this rank where it is at no cost until asked.
"""

from __future__ import annotations

import builtins
import ctypes
import faulthandler
import importlib.machinery
import io
import json
import os
import runpy
import signal
import sys
import time
import traceback
import types
import zipfile
from types import TracebackType

from ddprun import torch_internals
from ddprun.envnames import ERROR_FILE_ENV, LAUNCHER_PID_ENV, PID_FILE_ENV
from ddprun.worker import stackdump

_PR_SET_PDEATHSIG = 1
_USAGE = "usage: python -m ddprun.worker.bootstrap SCRIPT [ARGS...] | -m MODULE [ARGS...]"
# Frames of this file and of runpy sit above the user's code in every traceback; hide them.
_LAUNCH_FILES = frozenset({os.path.abspath(__file__), runpy.__file__, "<frozen runpy>"})


def die_with_launcher(*, expected_parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when the thread that spawned it dies.

    The launcher spawns workers from its main thread, so the signal follows the launcher
    itself. The parent may already be gone before prctl runs, hence the getppid check.
    `expected_parent`: the parent when it is not the launcher (warm start: the fork server,
    itself tied to the launcher the same way).
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    expected = expected_parent or os.environ.get(LAUNCHER_PID_ENV)
    if expected and os.getppid() != int(expected):
        os._exit(128 + signal.SIGKILL)


def run_user_code(argv: list[str]) -> None:
    """Run a script or `-m module` exactly as `python` would, with sys.argv set for it;
    `--no-python PROGRAM` replaces this process with the program (torchrun's --no-python)."""
    if argv[:1] == ["--no-python"]:
        # After the parent-death signal and the pid file: both survive exec, so the guarantees hold.
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvp(argv[1], argv[1:])
    if argv[:1] == ["-m"]:
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = argv[0], argv[1:]
        sys.argv = [script, *args]  # as typed, as python (and torchrun) leave it
        # `python -m` put the working directory first; `python script.py` puts the script's own.
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        _run_script(os.path.abspath(script))


def _run_script(path: str) -> None:
    """As `python path` runs it: a fresh __main__ whose __file__ is absolute (as python 3.9+ and
    torchrun make it), leaving sys.argv[0] as typed (runpy.run_path would set it to `path`).
    A folder or zip with __main__.py goes through runpy."""
    if not os.path.isfile(path) or zipfile.is_zipfile(path):
        runpy.run_path(path, run_name="__main__")
        return
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None, __package__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main  # pickle finds the script's classes in __main__, as under python
    exec(code, main.__dict__)


def user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """Drop the leading frames of this bootstrap and runpy, as `python script.py` shows none."""
    while tb is not None and tb.tb_frame.f_code.co_filename in _LAUNCH_FILES:
        tb = tb.tb_next
    return tb


def _file_state(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def write_error_file(path: str, exc: BaseException) -> None:
    """Record `exc`; a failure to write must never hide the user's own exception.

    Written to a temporary file, then renamed: the agent's SIGTERM can land mid-write, and
    torch's agent crashes on a truncated error file (JSONDecodeError in ProcessFailure).
    """
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as fp:
            json.dump(torch_internals.error_record(exc, now=time.time()), fp)
        os.replace(tmp, path)
    except Exception as err:  # an unwritable path, or an exception whose str() fails
        print(f"ddprun: could not write error file {path}: {err!r}", file=sys.stderr)


def _enable_faulthandler() -> None:
    # As torch's ErrorHandler.initialize does: a segfault then leaves a Python stack on stderr.
    try:
        faulthandler.enable(all_threads=True)
    except (RuntimeError, ValueError, OSError):
        pass


def _write_pid_file(pid: int) -> None:
    path = os.environ.get(PID_FILE_ENV)
    if path:
        try:
            with open(path, "w") as f:
                f.write(str(pid))
        except OSError:
            pass  # only the launcher's restart message loses the rank's name


def main(*, parent_pid: int | None = None) -> None:
    """`parent_pid`: under warm start (worker/warmserver.py) the rank's parent is the fork server."""
    argv = sys.argv[1:]
    if not argv or argv == ["-m"]:
        print(_USAGE, file=sys.stderr)
        raise SystemExit(2)
    die_with_launcher(expected_parent=parent_pid)
    _write_pid_file(os.getpid())
    _enable_faulthandler()
    stackdump.install()  # `ddprun stacks`, Ctrl-\ and the stall watch ask through it
    error_file = os.environ.get(ERROR_FILE_ENV) or None
    before = _file_state(error_file) if error_file else None
    try:
        run_user_code(argv)
    except KeyboardInterrupt as exc:
        _die_interrupted(exc)
    except Exception as exc:  # SystemExit passes through untouched
        exc.__traceback__ = user_traceback(exc.__traceback__)
        # A user's own @record has written the file already (same format): keep theirs.
        if error_file and _file_state(error_file) == before:
            write_error_file(error_file, exc)
        # What Python does with an uncaught exception, without our frames on top of it.
        _print_exception(exc)
        raise SystemExit(1) from None


def _die_interrupted(exc: KeyboardInterrupt) -> None:
    """The launcher forwarded Ctrl-C: say in one line where this rank was, then die by SIGINT
    as Python itself would, without a traceback on every rank's console."""
    frames = traceback.extract_tb(user_traceback(exc.__traceback__))
    where = f" in {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    print(f"interrupted{where}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


def _print_exception(exc: BaseException) -> None:
    """Print through the installed excepthook, except torch's (see torch_internals)."""
    hook = torch_internals.plain_excepthook()
    hook(type(exc), exc, exc.__traceback__)


if __name__ == "__main__":
    main()
