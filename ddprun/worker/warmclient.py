"""What torch elastic starts per rank under warm start: a small stand-in for the rank itself.

Usage: python -u -m ddprun.worker.warmclient SCRIPT [ARGS...]   (the bootstrap's arguments)

It imports no torch. With DDPRUN_WARM_SOCKET set, it hands its stdin/stdout/stderr, argv,
environment, cwd, sys.path, umask and CPU affinity to the node's warm-start server
(ddprun/worker/warmserver.py), which forks the rank; then it relays the signals torch and
ddprun send (SIGTERM, SIGINT, forwarded SIGUSR1, ..., the stacks signal only once the rank
catches it) and ends as the rank ended: its exit code, or killed by its signal. So torch sees
one process per rank, with the right exit code, logs and signals.

Without the variable, or when the server cannot take the rank (gone, refused), it becomes the
fresh rank itself: exec `python -u -m ddprun.worker.bootstrap ARGS`, keeping its pid.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys

from ddprun.envnames import CLIENT_PID_SUFFIX, LAUNCHER_PID_ENV, PID_FILE_ENV, STACKS_SIGNAL_OFFSET, WARM_SOCKET_ENV
from ddprun.worker import unixsocket

BOOTSTRAP_MODULE = "ddprun.worker.bootstrap"
_PR_SET_PDEATHSIG = 1
_RELAYED = ("SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGCONT", "SIGALRM")


def main() -> None:
    args = sys.argv[1:]
    path = os.environ.pop(WARM_SOCKET_ENV, None)  # the rank never sees it
    _die_with_launcher()
    if path:
        _write_client_pid()
        conn = _handed_over(path, args)
        if conn is not None:
            _relay_until_done(conn)
    _exec_fresh(args)


def _die_with_launcher() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        expected = os.environ.get(LAUNCHER_PID_ENV)
        if expected and os.getppid() != int(expected):
            os._exit(128 + signal.SIGKILL)


def _write_client_pid() -> None:
    """The launcher sees this process die, not the rank: beside the rank's pid file (which the rank
    writes with its own pid, for `ddprun stacks` and for people), this pid names the rank too."""
    path = os.environ.get(PID_FILE_ENV)
    if path:
        try:
            fd = os.open(path + CLIENT_PID_SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
        except OSError:
            pass


def _handed_over(path: str, args: list[str]) -> socket.socket | None:
    """Connected, the request sent and the rank's pid back; None: start fresh instead."""
    fds = [fd for fd in (0, 1, 2) if _is_open(fd)]
    request = {
        "argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "path": sys.path, "umask": _umask(),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "fds": fds,
    }
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        with unixsocket.address(path) as name:
            conn.connect(name)
        socket.send_fds(conn, [json.dumps(request).encode()], fds)
        reply = conn.recv(4096)
    except OSError:
        conn.close()
        return None
    if not reply:
        conn.close()
        return None
    _relay_to(json.loads(reply)["pid"])
    return conn


def _relay_until_done(conn: socket.socket) -> None:
    try:
        reply = conn.recv(4096)
    except OSError:
        reply = b""
    if not reply:  # the server died, and with it (parent-death signal) the rank
        print("ddprun: the warm-start server ended while this rank ran", file=sys.stderr, flush=True)
        _die_by(signal.SIGKILL)
    outcome = json.loads(reply)
    if "signal" in outcome:
        _die_by(outcome["signal"])
    os._exit(outcome["exit"])


def _relay_to(pid: int) -> None:
    stacks = signal.SIGRTMIN + STACKS_SIGNAL_OFFSET

    def relay(signum: int, _frame: object) -> None:
        if signum == stacks and not _catches(pid, signum):
            return  # the rank has not set up its stack dumps yet: the question would kill it
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for name in _RELAYED:
        signal.signal(getattr(signal, name), relay)
    signal.signal(stacks, relay)


def _catches(pid: int, signum: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            line = next(line for line in status if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)


def _die_by(signum: int) -> None:
    """End as the rank did: killed by the same signal (torch reports -signum), without a core."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)


def _exec_fresh(args: list[str]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-u", "-m", BOOTSTRAP_MODULE, *args])


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


if __name__ == "__main__":
    main()
