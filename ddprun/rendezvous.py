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

from ddprun import portinfo, torch_internals
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


def serve_store(sock: socket.socket, *, host: str, implementation: str) -> Any:
    """A multi-tenant TCPStore server on an already-listening socket.

    A store that owns the socket from then on (see torch_internals) gets it detached, so that
    Python never closes the fd under it, not even at interpreter exit."""
    store = torch_internals.serve_store_on_socket(
        sock.fileno(), host=host, port=sock.getsockname()[1], implementation=implementation)
    if torch_internals.store_owns_socket(implementation):
        sock.detach()
    return store


@contextlib.contextmanager
def hold_store(host: str, port: int, *, implementation: str, flag: str = "--port") -> Iterator[HeldStore]:
    """Host the rendezvous store on host:port for the duration of the job."""
    sock = bind_listener(host, port, flag=flag)
    bound = sock.getsockname()[1]
    try:
        store = serve_store(sock, host=host, implementation=implementation)
        yield HeldStore(host=host, port=bound, store=store, sock=sock)
    finally:
        sock.close()  # a no-op once detached


class WorkerStores:
    """The stores ddprun serves for the workers: a fresh, empty one for every start of them.

    torch keeps one worker store for every attempt, so restarted ranks can read the keys of
    the dead attempt (gloo's peer addresses, barrier counters) and hang or fail; plain
    torchrun --max-restarts trips on this most of the time on torch 2.14. Each store listens
    on `bind_host` only, and lives (with its socket) as long as the launcher.
    """

    def __init__(self, *, bind_host: str, implementation: str, say: Callable[[str], None] = lambda text: None) -> None:
        self.bind_host, self.implementation, self._say = bind_host, implementation, say
        self._kept: list[Any] = []

    def serve(self) -> int:
        """A new store on a free port of `bind_host`; returns the port."""
        sock = bind_listener(self.bind_host, 0)
        port = sock.getsockname()[1]
        self._kept += [sock, serve_store(sock, host=self.bind_host, implementation=self.implementation)]
        return port

    def fresh_for(self, envs: dict[int, dict[str, str]]) -> None:
        """Point this start of the workers at a store of their own."""
        torch_internals.point_workers_at(envs, host=self.bind_host, port=self.serve(), agent_store=True)

    def handler_creator(self) -> Callable[[Any], Any]:
        """Registry creator for multi-node hosts: torch's c10d handler, with node 0's worker store
        bound to `bind_host` where this torch lets ddprun make it (see torch_internals)."""

        def create(params: Any) -> Any:
            from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
            from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

            backend, store = create_backend(params)
            handler = create_handler(store, backend, params)
            if not torch_internals.keep_worker_store_local(handler, self._multi_node_store, name=BACKEND_NAME):
                self._say(f"note: this torch's rendezvous handler has no hook for node 0's worker store, so rank 0 "
                          f"serves it on every interface, not {self.bind_host} only (torch's own behaviour).")
            return handler

        return create

    def _multi_node_store(self, master_addr: str, master_port: int) -> Any:
        sock = bind_listener(self.bind_host, master_port)
        store = serve_store(sock, host=master_addr, implementation=self.implementation)
        self._kept += [sock, store]
        return store


_registered: list[WorkerStores] = []  # the current job's stores; torch's registry takes one creator per name


def register_backend(stores: WorkerStores) -> str:
    """Register the c10d handler whose node-0 worker store listens on `stores.bind_host` only."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    if not _registered:
        rendezvous_handler_registry.register(BACKEND_NAME, lambda params: _registered[-1].handler_creator()(params))
    _registered.append(stores)
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
        if count >= wanted:  # enough nodes came: torch was still waiting out last_call_timeout for more
            return (f"{count} of {self.nnodes} nodes joined at {self.endpoint} within {self.timeout_s:g} s, enough for "
                    f"the minimum of {wanted}, but the rendezvous waits last_call_timeout (30 s by default) for more "
                    "before it starts: lower it with --rdzv-conf last_call_timeout=N, or raise --join-timeout above it")
        missing = wanted - count
        return (f"only {count} of {wanted} nodes joined at {self.endpoint} within {self.timeout_s:g} s: "
                f"{missing} node{'s' if missing != 1 else ''} missing")
