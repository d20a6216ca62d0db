"""The warm-start server: one per node, imports torch once, then forks one process per rank.

Usage: python -u -m ddprun.worker.warmserver --socket PATH --parent-pid PID --preload torch,...

The launcher starts it (ddprun/warmstart.py) before its own torch import; it listens on a Unix
socket in a private (0700) folder at once, then imports the preloaded modules. torch elastic
still starts one small process per rank (ddprun/worker/warmclient.py): it connects, passes its
stdin/stdout/stderr, argv, environment, cwd, sys.path, umask and CPU affinity, and relays
signals. The server forks a child per request that takes all of those on, as a fresh
interpreter would have them, and runs the bootstrap's main (ddprun/worker/bootstrap.py) in it.
The server tells the client the child's pid, then how it ended; it SIGKILLs the child when its
client goes away (torch's SIGKILL after the grace period lands on the client).

Nothing here initialises CUDA or a thread pool: the server only imports. It has the launcher's
parent-death signal, and each child has the server's, so a kill -9 of the launcher leaves nothing.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
from dataclasses import dataclass, field

from ddprun import gcpause
from ddprun.worker import bootstrap, unixsocket, warmexit

_MAX_REQUEST = 1 << 20
_POLL_S = 0.1  # where os.pidfd_open is missing: how often exited children are looked for
# What a fresh `python` has: Python's own handlers for these, the default action for the rest.
_PYTHON_IGNORES = ("SIGPIPE", "SIGXFSZ")
# The launcher relays these to its direct children (--forward-signal, Ctrl-C): meant for the ranks,
# which their clients relay them to. Only SIGTERM (the launcher's stop) and death end the server.
_SERVER_IGNORES = ("SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


@dataclass
class Request:
    """One rank's start, as its client sent it; `fds` are the client's own 0, 1, 2 (None: closed)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    path: list[str]
    umask: int
    affinity: list[int] | None
    fds: dict[int, int] = field(default_factory=dict)


@dataclass
class _Rank:
    conn: socket.socket
    pid: int = 0
    pidfd: int | None = None


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv if argv is not None else sys.argv[1:])
    listener = _listen(args["socket"])  # first: clients may connect while torch imports
    bootstrap.die_with_launcher(expected_parent=int(args["parent-pid"]))
    for name in _SERVER_IGNORES:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    environ_before = dict(os.environ)
    with gcpause.paused():  # and frozen: the ranks' collections never walk (or copy) what it imported
        for name in filter(None, args.get("preload", "").split(",")):
            __import__(name)
    _refuse_if_cuda_started()
    set_by_imports = {k: v for k, v in os.environ.items() if environ_before.get(k) != v}
    server_pid = os.getpid()
    request = _serve(listener)  # returns only in a forked child
    listener.close()
    imported = list(sys.modules)
    _become_rank(request, set_by_imports=set_by_imports)
    warmexit.end(_run_rank(server_pid), imported_before=imported)


def _run_rank(server_pid: int) -> int:
    try:
        bootstrap.main(parent_pid=server_pid)
    except SystemExit as exit:
        return warmexit.exit_code(exit.code)
    return 0


def _refuse_if_cuda_started() -> None:
    """A rank forked after CUDA started cannot use it: if an import started it (torch's lazy init,
    or anything that loaded the driver), end here. The launcher says so once; ranks start fresh."""
    torch = sys.modules.get("torch")
    started = torch is not None and torch.cuda.is_initialized()
    try:
        with open("/proc/self/maps") as maps:
            driver = any("libcuda.so" in line for line in maps)
    except OSError:
        driver = False
    if started or driver:
        print("ddprun warm start: CUDA was started while importing the preloaded modules; "
              "a forked rank could not use it, so this server serves no rank", file=sys.stderr, flush=True)
        os._exit(3)


def rank_environment(sent: dict[str, str], set_by_imports: dict[str, str]) -> dict[str, str]:
    """The rank's environment: its client's, plus what the server's imports set where the client's
    has no value (torchvision's import sets TORCHINDUCTOR_CACHE_DIR, as it would in a fresh rank)."""
    return {**set_by_imports, **sent}


def _parse(argv: list[str]) -> dict[str, str]:
    pairs = dict(zip(argv[::2], argv[1::2]))
    return {key.lstrip("-"): value for key, value in pairs.items()}


def _listen(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with unixsocket.address(path) as name:
        listener.bind(name)
    os.chmod(path, 0o600)
    listener.listen(4096)
    return listener


def _serve(listener: socket.socket) -> Request:
    """Accept and fork until the launcher ends it (SIGTERM, or its death). Returns in a child only."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    ranks: dict[socket.socket, _Rank] = {}
    while True:
        for key, _ in selector.select(timeout=None if hasattr(os, "pidfd_open") else _POLL_S):
            if key.data is None:
                _accept(listener, selector, ranks)
            elif isinstance(key.data, _Rank) and key.fileobj is key.data.conn:
                request = _on_client(key.data, selector, ranks)
                if request is not None:
                    return request
            else:
                _reap(key.data, selector, ranks)
        if not hasattr(os, "pidfd_open"):
            for rank in [r for r in ranks.values() if r.pid]:
                _reap(rank, selector, ranks, block=False)


def _accept(listener: socket.socket, selector: selectors.BaseSelector, ranks: dict) -> None:
    conn, _ = listener.accept()
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    if int.from_bytes(creds[4:8], sys.byteorder) != os.getuid():  # the folder is 0700; belt and braces
        conn.close()
        return
    ranks[conn] = _Rank(conn)
    selector.register(conn, selectors.EVENT_READ, ranks[conn])


def _on_client(rank: _Rank, selector: selectors.BaseSelector, ranks: dict) -> Request | None:
    if rank.conn.fileno() == -1:  # reaped and dropped earlier in this round
        return None
    if rank.pid:  # the client went away (torch's SIGKILL) while its rank runs: the rank goes too
        _kill(rank.pid)
        selector.unregister(rank.conn)
        return None
    try:
        data, fds, _, _ = socket.recv_fds(rank.conn, _MAX_REQUEST, 3)
        request = _request(data, fds) if data else None
    except (OSError, ValueError, KeyError):
        request = None
    if request is None:
        _drop(rank, selector, ranks)
        return None
    pid = os.fork()
    if pid == 0:
        selector.close()
        for other in ranks.values():
            _close_rank(other)
        return request
    for fd in request.fds.values():
        os.close(fd)
    rank.pid = pid
    _send(rank.conn, {"pid": pid})
    if hasattr(os, "pidfd_open"):
        rank.pidfd = os.pidfd_open(pid)
        selector.register(rank.pidfd, selectors.EVENT_READ, pid)
    return None


def _request(data: bytes, fds: list[int]) -> Request:
    fields = json.loads(data)
    sent = fields.pop("fds")
    return Request(**fields, fds=dict(zip(sent, fds)))


def _reap(target: int | _Rank, selector: selectors.BaseSelector, ranks: dict, *, block: bool = True) -> None:
    rank = target if isinstance(target, _Rank) else next(r for r in ranks.values() if r.pid == target)
    done, status = os.waitpid(rank.pid, 0 if block else os.WNOHANG)
    if not done:
        return
    if os.WIFSIGNALED(status):
        _send(rank.conn, {"signal": os.WTERMSIG(status)})
    else:
        _send(rank.conn, {"exit": os.waitstatus_to_exitcode(status)})
    _drop(rank, selector, ranks)


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:
        pass  # the client is gone; its rank is killed or already ended


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _drop(rank: _Rank, selector: selectors.BaseSelector, ranks: dict) -> None:
    for obj in (rank.conn, rank.pidfd):
        if obj is not None:
            try:
                selector.unregister(obj)
            except (KeyError, ValueError):
                pass
    _close_rank(rank)
    ranks.pop(rank.conn, None)


def _close_rank(rank: _Rank) -> None:
    rank.conn.close()
    if rank.pidfd is not None:
        os.close(rank.pidfd)
        rank.pidfd = None


# --- in the child: become the rank, as a fresh interpreter would be ----------------------------


def _become_rank(request: Request, *, set_by_imports: dict[str, str]) -> None:
    os.setsid()  # as torch's Popen(start_new_session=True) makes every rank
    for target in (0, 1, 2):
        if target in request.fds:
            os.dup2(request.fds[target], target)
        else:
            os.close(target)
    for fd in set(request.fds.values()) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request.cwd)
    os.umask(request.umask)
    if request.affinity is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, request.affinity)
    os.environ.clear()
    os.environ.update(rank_environment(request.env, set_by_imports))
    sys.path[:] = request.path
    sys.argv = [bootstrap.__file__, *request.argv]
    _python_signal_defaults()
    _fresh_state(request.argv)


def _python_signal_defaults() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in _PYTHON_IGNORES:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def _fresh_state(argv: list[str]) -> None:
    """What the server's imports left that a fresh interpreter would not share with its peers."""
    import importlib

    importlib.invalidate_caches()  # files written since the server looked (the user's script)
    if argv[:1] == ["-m"]:
        sys.modules.pop(argv[1], None)  # preloaded (the trainer): runs afresh as __main__, no runpy warning
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()  # numpy seeds its global generator from the OS at import, once
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        process.current_process().authkey = os.urandom(32)


if __name__ == "__main__":
    main()
