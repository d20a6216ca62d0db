"""Race-free rendezvous: ddprun binds the store's socket itself and never lets go of it.

torchrun picks a port, releases it and binds it again, so two jobs started together can
collide or join each other's store; and its stores listen on every interface. Here the
launcher binds the endpoint's own address (loopback for one node), hands the bound socket
to a TCPStore through `master_listen_fd`, and keeps it for the job's whole life. torch's
rendezvous code then finds that server through TCPStore's multi-tenant cache instead of
binding again. The second store torch makes for the workers is kept on the same address.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ddprun import portinfo
from ddprun.errors import UsageError

# The registered rendezvous backend: torch's c10d handler, with its worker store kept local.
BACKEND_NAME = "ddprun-c10d"
_LISTEN_BACKLOG = 2048


class PortTakenError(UsageError):
    """The store's port is in use: by another program, or by this job's own store host."""


@dataclass
class HeldStore:
    host: str
    port: int
    store: Any  # torch.distributed.TCPStore
    sock: socket.socket


def bind_listener(host: str, port: int, *, flag: str = "--port") -> socket.socket:
    """Bind and listen on host:port (0 = any free port). A taken port is a usage error naming its holder."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # SO_REUSEADDR only skips TIME_WAIT leftovers; Linux still refuses a port someone listens on.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(_LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortTakenError(_port_taken_message(host, port, flag=flag)) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise UsageError(f"{host} is not an address of this machine, so its store cannot listen there") from None
        raise
    return sock


def _port_taken_message(host: str, port: int, *, flag: str) -> str:
    holder = portinfo.port_holder(port)
    held_by = f", held by {holder}" if holder else ""
    if flag == "--port":
        given, other = f"{port}", f"{port + 1}"
    else:
        shown = f"[{host}]" if ":" in host else host
        given, other = f"{shown}:{port}", f"{shown}:{port + 1}"
    return f"{flag} {given}: the port is already in use on {host}{held_by}. Use another port, e.g. {flag} {other}"


def serve_store(sock: socket.socket, *, host: str) -> Any:
    """A multi-tenant TCPStore server on an already-listening socket."""
    import torch.distributed as dist

    return dist.TCPStore(
        host, sock.getsockname()[1], is_master=True, multi_tenant=True,
        wait_for_workers=False, master_listen_fd=sock.fileno(),
    )


@contextlib.contextmanager
def hold_store(host: str, port: int, *, flag: str = "--port") -> Iterator[HeldStore]:
    """Host the rendezvous store on host:port for the duration of the job."""
    sock = bind_listener(host, port, flag=flag)
    try:
        store = serve_store(sock, host=host)
        yield HeldStore(host=host, port=sock.getsockname()[1], store=store, sock=sock)
    finally:
        sock.close()


class _LocalStoreHandlers:
    """Registry creator: torch's c10d rendezvous handler, with the workers' store bound to one address."""

    def __init__(self) -> None:
        self.bind_host = "127.0.0.1"
        self.sockets: list[socket.socket] = []  # kept open for the job's life, like the stores
        self.stores: list[Any] = []

    def __call__(self, params: Any) -> Any:
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        backend, store = create_backend(params)
        handler = create_handler(store, backend, params)
        # torch makes the workers' store with TCPStore(addr, 0), which listens on every
        # interface: hand it a socket bound to our address instead. If a torch release
        # renames these hooks, fail loudly rather than silently listen on '*'.
        for hook in ("_create_tcp_store_server", "_backend_name"):
            if not hasattr(handler, hook):
                raise RuntimeError(f"this torch release has no DynamicRendezvousHandler.{hook}")
        handler._create_tcp_store_server = self._worker_store
        handler._backend_name = BACKEND_NAME  # the registry checks the name it was asked for
        return handler

    def _worker_store(self, master_addr: str, master_port: int) -> Any:
        sock = bind_listener(self.bind_host, master_port)
        self.sockets.append(sock)
        return serve_store(sock, host=master_addr)


_HANDLERS = _LocalStoreHandlers()


def fresh_worker_store(number: int, envs: dict[int, dict[str, str]]) -> None:
    """Give a restarted single-node attempt a new, empty worker store.

    torch keeps one worker store for every attempt, so restarted ranks can read the keys of
    the dead attempt (gloo's peer addresses, barrier counters) and hang or fail; plain
    torchrun --max-restarts trips on this most of the time on torch 2.14.
    """
    if number == 0:
        return
    sock = bind_listener(_HANDLERS.bind_host, 0)
    _HANDLERS.sockets.append(sock)
    _HANDLERS.stores.append(serve_store(sock, host=_HANDLERS.bind_host))
    for env in envs.values():
        env["MASTER_PORT"] = str(sock.getsockname()[1])


def register_backend(*, bind_host: str) -> str:
    """Register (once per process) the c10d handler whose worker store listens on `bind_host` only."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    _HANDLERS.bind_host = bind_host
    rendezvous_handler_registry.register(BACKEND_NAME, _HANDLERS)
    return BACKEND_NAME


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """("host", port) of a plan's "host:port" or "[v6]:port" endpoint (already validated)."""
    host, port = endpoint.rsplit(":", 1)
    return host.strip("[]"), int(port)


def with_port(endpoint: str, port: int) -> str:
    return f"{endpoint.rsplit(':', 1)[0]}:{port}"


def local_address(host: str) -> str | None:
    """The address of `host` that this machine can listen on, or None if it is another machine's."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
            except OSError:
                continue
            return address[0]
    return None


# --- joining: a visible wait, a count of the nodes that came, a clear timeout -------------------

JOINED_KEY = "ddprun/joined/{rdzv_id}"
_REPORT_EVERY_S = 5.0


class JoinWatch:
    """While the nodes gather, say so every few seconds; count who joined through the store.

    Every ddprun node adds 1 to a counter in the rendezvous store once it reaches it, so a
    timeout can say how many nodes are missing. `started()` ends the wait: the workers run.
    """

    def __init__(self, *, endpoint: str, rdzv_id: str, nnodes: str, timeout_s: float,
                 say: Callable[[str], None], store: Any = None) -> None:
        self.endpoint, self.nnodes, self.timeout_s, self._say = endpoint, nnodes, timeout_s, say
        self._key = JOINED_KEY.format(rdzv_id=rdzv_id)
        self._store = store
        self._done = threading.Event()
        self._began = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="ddprun-join-watch", daemon=True)

    def __enter__(self) -> "JoinWatch":
        if self._store is not None:
            self._store.add(self._key, 1)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def started(self) -> None:
        self._done.set()

    def joined(self) -> int | None:
        try:
            return int(self._store.add(self._key, 0)) if self._store is not None else None
        except Exception:  # the store host went away: the count is unknown, not an error of its own
            return None

    def _watch(self) -> None:
        if self._store is None:
            self._connect()
        while not self._done.wait(_REPORT_EVERY_S):
            self._say(self.waiting_line())

    def _connect(self) -> None:
        import datetime

        import torch.distributed as dist

        host, port = split_endpoint(self.endpoint)
        try:
            store = dist.TCPStore(host, port, is_master=False,
                                  timeout=datetime.timedelta(seconds=max(1.0, self.timeout_s)))
            store.add(self._key, 1)
            self._store = store
        except Exception:  # torch's own rendezvous reports the failure to connect
            pass

    def waiting_line(self) -> str:
        waited = int(time.monotonic() - self._began)
        count = self.joined()
        progress = f", {count} of {self.nnodes} nodes here" if count is not None else ""
        return f"waiting for the nodes at {self.endpoint}... {waited} s{progress}"

    def timeout_message(self) -> str:
        count = self.joined()
        wanted = int(self.nnodes.split(":")[0])
        if count is None:
            return (f"no answer from the store at {self.endpoint} within {self.timeout_s:g} s: "
                    f"node 0 never came up, or the port is closed between the nodes")
        missing = max(wanted - count, 0)
        return (f"only {count} of {wanted} nodes joined at {self.endpoint} within {self.timeout_s:g} s: "
                f"{missing} node{'s' if missing != 1 else ''} missing")
