"""Nothing outlives the job: the processes the workers leave behind are stopped when it ends.

While a job runs, the launcher is a child subreaper (Linux PR_SET_CHILD_SUBREAPER): a process
orphaned anywhere below it (a worker's child whose worker exited, one that called setsid, a
double-forked daemon) is reparented to the launcher instead of pid 1, so it stays in the
launcher's process tree. When the job ends (success, failure, a graceful stop after Ctrl-C
or SIGTERM), every process still below the launcher gets SIGTERM, SIGKILL once the grace
period is over (sooner, if they leave sooner), and is reaped. A second Ctrl-C SIGKILLs the
whole tree at once.

A launcher killed by SIGKILL cleans up nothing. For that case a watchdog starts before the
workers: a small Python process in a session of its own, outside the launcher's tree, that
holds the read end of a pipe whose write end only the launcher holds (close-on-exec, so no
worker inherits it). A launcher that finished its cleanup writes "done" and closes the pipe,
and the watchdog leaves. Any other end of the launcher (kill -9, the OOM killer, a crash)
reaches the watchdog as end-of-file: it SIGKILLs every process of the same user whose
environment carries this job's marker (DDPRUN_JOB=<token unique to this launcher>), then
leaves.

What is guaranteed, on Linux:
- The launcher ends its job (success, failure, Ctrl-C, SIGTERM, second Ctrl-C): no process
  started below it is left running, whatever its session, process group or environment.
  Only a process stuck in the kernel (D state) can outlast SIGKILL; it is given 5 s.
- The launcher is killed with SIGKILL: the workers die at once (PR_SET_PDEATHSIG, see
  worker/bootstrap.py); the watchdog SIGKILLs every other process of this user that was
  started with the job's marker in its environment, which every descendant inherits.
Not covered: after a SIGKILL of the launcher, a descendant that exec'd with an environment
without DDPRUN_JOB (`env -i`, a cleared `env=`), or that changed its user; a SIGKILL of the
launcher and its watchdog together; processes started on the job's behalf by another service
(systemd-run, a container runtime, ssh), which are not descendants at all. Only a cgroup (a
systemd scope, a container) holds every process of a job. Between restarts (--max-restarts) a
failed attempt's leftovers keep running until the job ends; one that exits during the job
stays a zombie until then, since reaping it earlier could take a worker's exit status from
torch.

psutil is imported when first needed: the CLI's fast paths never get here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from ddprun.envnames import JOB_MARKER_ENV
from ddprun.errors import DdprunError

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_DONE = b"d"  # the launcher's last word to its watchdog: cleaned up, kill nothing
_POLL_S = 0.05
_KILL_WAIT_S = 5.0  # after SIGKILL only a process stuck in the kernel takes longer
_HARD_STOP_S = 1.0  # the second Ctrl-C: the user asked for no waiting
_SWEEP_ROUNDS = 20  # the watchdog's passes: a process forked during one is caught by the next


@contextlib.contextmanager
def job_reaper(*, grace_period_s: float, say: Callable[[str], None] = lambda _text: None) -> Iterator[str]:
    """Around one job: a watchdog, subreaping, and the job's marker in os.environ (set before
    the workers start, so they inherit it). Yields the marker.

    On the way out, every process left below this one is stopped (SIGTERM, then SIGKILL after
    `grace_period_s`) and reaped; `say` names them. The watchdog is told "done" only after that.
    """
    marker = new_marker(os.getpid())
    watchdog_done = _start_watchdog(marker)  # before subreaping: the watchdog must not be ours
    was_subreaper = _set_subreaper(True)
    saved_marker = os.environ.get(JOB_MARKER_ENV)
    os.environ[JOB_MARKER_ENV] = marker
    try:
        yield marker
    finally:
        try:
            _report_leftovers(stop_descendants(grace_period_s=grace_period_s), say=say)
        except BaseException:  # Ctrl-C during the grace period: no more waiting
            kill_descendants(signal.SIGKILL)
            raise
        _set_subreaper(was_subreaper)
        _restore_env(JOB_MARKER_ENV, saved_marker)
        watchdog_done()


def new_marker(pid: int) -> str:
    """A token no other launcher on this machine carries: the pid, for a person, and random bits."""
    return f"{pid}-{os.urandom(8).hex()}"


def is_marked(environ: Mapping[str, str], *, marker: str) -> bool:
    return environ.get(JOB_MARKER_ENV) == marker


# --- the launcher's side: its own tree --------------------------------------------------------


def stop_descendants(*, grace_period_s: float) -> list[str]:
    """SIGTERM every process below this one, SIGKILL what is left after the grace period, reap
    them all. Returns "name (pid N)" for each process found. Polls: no wait when none is left."""
    found = _living_descendants()
    described = [_describe(p) for p in found]  # before they are gone
    _signal_all(found, signal.SIGTERM)
    left = _wait_until_gone(timeout_s=grace_period_s)
    deadline = time.monotonic() + _KILL_WAIT_S
    while left and time.monotonic() < deadline:
        _signal_all(left, signal.SIGKILL)  # again on each pass: one may have forked meanwhile
        left = _wait_until_gone(timeout_s=_POLL_S)
    return described


def kill_descendants(sig: signal.Signals) -> None:
    """Signal every living process below this one (the hard stop). SIGKILL is sent again until
    none is left, for at most a second: one may have forked meanwhile."""
    deadline = time.monotonic() + _HARD_STOP_S
    while living := _living_descendants():
        _signal_all(living, sig)
        if sig != signal.SIGKILL or time.monotonic() >= deadline:
            return
        time.sleep(_POLL_S / 5)


def _living_descendants() -> list[Any]:
    """psutil.Process of every process below this one that has not exited. Reaps this
    process's exited children on the way, so none is left a zombie."""
    import psutil

    living = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                living.append(process)
                continue
        except psutil.NoSuchProcess:
            continue
        with contextlib.suppress(ChildProcessError):  # a grandchild: its own parent reaps it
            os.waitpid(process.pid, os.WNOHANG)
    return living


def _wait_until_gone(*, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    while (left := _living_descendants()) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    return left


def _signal_all(processes: list[Any], sig: signal.Signals) -> None:
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.Error):  # send_signal checks the pid was not reused
            process.send_signal(sig)


def _describe(process: Any) -> str:
    import psutil

    try:
        return f"{process.name()} (pid {process.pid})"
    except psutil.Error:
        return f"pid {process.pid}"


def _report_leftovers(described: list[str], *, say: Callable[[str], None]) -> None:
    if described:
        shown = ", ".join(described[:4]) + (f" and {len(described) - 4} more" if len(described) > 4 else "")
        say(f"ended {len(described)} process(es) the workers left running: {shown}")


def _set_subreaper(on: bool) -> bool:
    """Turn subreaping on or off; returns whether it was on. A no-op off Linux."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    was = ctypes.c_int(0)
    libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    return bool(was.value)


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


# --- the watchdog -----------------------------------------------------------------------------


def _start_watchdog(marker: str) -> Callable[[], None]:
    """Start the watchdog and return the function that tells it the launcher is done.

    Its starter forks it and exits at once, so it is reparented to init (this process is not
    yet a subreaper) and no signal or wait meant for the launcher's children reaches it.
    """
    read_fd, write_fd = os.pipe()  # both close-on-exec: only the watchdog gets the read end
    try:
        starter = subprocess.Popen(
            [sys.executable, "-m", __name__, str(read_fd), marker],
            pass_fds=(read_fd,), start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, env=_watchdog_env(os.environ),
        )
    finally:
        os.close(read_fd)
    if starter.wait() != 0:
        os.close(write_fd)
        raise DdprunError(f"could not start ddprun's watchdog: {sys.executable} -m {__name__} "
                          f"exited with {starter.returncode}")

    def done() -> None:
        with contextlib.suppress(OSError):
            os.write(write_fd, _DONE)
        os.close(write_fd)

    return done


def _watchdog_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment without a marker, with this very ddprun first on the path."""
    package_parent = str(Path(__file__).resolve().parents[1])
    paths = [package_parent] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {k: v for k, v in environ.items() if k != JOB_MARKER_ENV}
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def launcher_died(read_fd: int) -> bool:
    """Block until the launcher closes its end; True unless it said "done" first."""
    said = b""
    while chunk := os.read(read_fd, 64):
        said += chunk
    return _DONE not in said


def sweep(marker: str, *, uid: int, me: int) -> None:
    """SIGKILL every process of `uid` but `me` whose environment carries `marker`, until none is left."""
    for _ in range(_SWEEP_ROUNDS):
        marked = list(_marked_processes(marker, uid=uid, me=me))
        if not marked:
            return
        _signal_all(marked, signal.SIGKILL)
        time.sleep(_POLL_S)


def _marked_processes(marker: str, *, uid: int, me: int) -> Iterator[Any]:
    import psutil

    for process in psutil.process_iter(["uids"]):
        uids = process.info["uids"]
        if process.pid == me or uids is None or uids.real != uid:
            continue
        try:
            environ = process.environ()  # a zombie's is empty: it is dead already
        except psutil.Error:
            continue
        if is_marked(environ, marker=marker):
            yield process


def _watchdog_main(argv: list[str]) -> None:
    """python -m ddprun.reaper READ_FD MARKER: fork the watchdog and return at once."""
    read_fd, marker = int(argv[0]), argv[1]
    if os.fork():
        os._exit(0)  # the starter: the launcher waits for this
    if launcher_died(read_fd):
        sweep(marker, uid=os.getuid(), me=os.getpid())
    os._exit(0)


if __name__ == "__main__":
    _watchdog_main(sys.argv[1:])
