"""How a warm rank ends: as Python ends a process, short of tearing down what the server imported.

A rank forked from the warm-start server shares the server's torch with it, page by page.
Python's own teardown would deallocate every one of those objects, copying each page it touches:
0.28 s of CPU per rank with torch imported, 2.6 s for 8 ranks on 2 cores (measured), for nothing
a user's code can see. So a warm rank ends as Py_FinalizeEx would, step by step, up to its
module teardown:

1. it waits for the non-daemon threads;
2. it runs the atexit handlers (logging's, multiprocessing's, weakref.finalize's, the user's);
3. it flushes every file the user's code left open (a collection may finalise a file's buffer
   before the text layer above it, losing what that layer held);
4. it lets go of the user's state: the modules imported since the fork (the script's __main__
   among them) leave sys.modules and the garbage is collected, so the user's objects are
   deallocated and their __del__ run; what those wrote to files still open is flushed;
5. it flushes stdout and stderr (exit code 120 if stdout cannot be, as Python's);

then os._exit with the exit code Python would have given.
"""

from __future__ import annotations

import gc
import io
import os
import sys
import threading
from typing import Iterable

from ddprun import torch_internals

_FLUSH_FAILED = 120  # Python's exit code when stdout cannot be flushed at exit


def exit_code(code: object) -> int:
    """The process's exit code for `sys.exit(code)`, as Python computes it (a message: printed, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF  # what the parent's wait sees of it
    print(code, file=sys.stderr)
    return 1


def end(code: int, *, imported_before: Iterable[str]) -> None:
    """End the process; `imported_before`: the modules the rank had when it was forked."""
    _wait_for_threads()
    torch_internals.run_exit_handlers()
    _flush_open_files()
    _release_user_state(set(imported_before))
    _flush_open_files()
    if not _flushed(sys.stdout):
        code = _FLUSH_FAILED
    _flushed(sys.stderr)
    os._exit(code)


def _wait_for_threads() -> None:
    """threading's shutdown: join every non-daemon thread, including those started meanwhile."""
    while True:
        waiting = [t for t in threading.enumerate()
                   if t is not threading.current_thread() and not t.daemon and t.is_alive()]
        if not waiting:
            return
        for thread in waiting:
            thread.join()


def _release_user_state(imported_before: set[str]) -> None:
    for name in [name for name in sys.modules if name not in imported_before or name == "__main__"]:
        sys.modules.pop(name, None)
    gc.collect()


def _flush_open_files() -> None:
    """The open files created since the fork (the server's objects are frozen out of gc's lists):
    flushed, not closed, since a wrapper still holding one may write to it."""
    standard = {id(s) for s in (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__)}
    for obj in gc.get_objects():
        if isinstance(obj, (io.BufferedIOBase, io.TextIOBase)) and id(obj) not in standard:
            _flushed(obj)


def _flushed(stream: object) -> bool:
    try:
        if stream is not None and not stream.closed and stream.writable():
            stream.flush()
    except Exception:  # noqa: BLE001  (Python's teardown ignores these too)
        return False
    return True
