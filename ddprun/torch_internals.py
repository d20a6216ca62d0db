"""Everything ddprun takes from torch's private or version-dependent API, in one room.

A torch upgrade should change this file and no other. Each use below has:
  - a feature check against the installed torch (never a bare version compare at run time),
  - the torch releases it was verified on,
  - a fallback that keeps the job running, with one warning line naming what is lost.

`features_for(version)` is the same knowledge as a pure table, read from package metadata
without importing torch, so that `--dry-run --json` states what a launch would really do.
torch is imported lazily, inside the functions that need it: the worker's bootstrap imports
this module too (for the error-file format) and must not pay for torch.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import traceback
from typing import Any, Callable, Mapping

from ddprun.errors import UsageError

TORCH_FLOOR = (2, 4)  # the oldest release the CI runs real launches on
NEWEST_TESTED = (2, 14)  # the newest release the CI runs real launches on
TESTED_RELEASES = ("2.4.0", "2.14.1")

# torch.distributed's TCPStore on libuv accepts an already-listening socket only from 2.8 on;
# before it raises NotImplementedError ("does not support initialization with an listen fd").
_LIBUV_LISTEN_FD_SINCE = (2, 8)
# torch's DynamicRendezvousHandler shares one worker store server per node (created by the
# agent, listening on every interface) unless this variable is "1"; read since torch 2.5.
DISABLE_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_WARM_TRAINER_VERIFIED = (2, 14)


# --- the installed torch, without importing it ----------------------------------------------


def installed_torch_version() -> str | None:
    """torch's release from package metadata (milliseconds; `import torch` takes seconds)."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of "2.14.1+cu128", "2.9.0a0+git...", "2.4.0"."""
    match = re.match(r"(\d+)\.(\d+)", text)
    if not match:
        raise ValueError(f"not a torch release: {text!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch_version(text: str | None) -> list[str]:
    """Refuse a torch below the floor (exit 2); a newer one than tested runs, with one notice."""
    floor = ".".join(map(str, TORCH_FLOOR))
    if text is None:
        raise UsageError(f"torch is not installed; ddprun needs torch >= {floor}: pip install 'torch>={floor}'")
    version = parse_version(text)
    if version < TORCH_FLOOR:
        raise UsageError(f"torch {text} is installed, but ddprun needs torch >= {floor}; "
                         f"pip install 'torch>={floor}', or use ddprun < 0.2 with it")
    if version > NEWEST_TESTED:
        newest = ".".join(map(str, NEWEST_TESTED))
        return [f"torch {text} is newer than the newest release ddprun was tested on ({newest}); "
                f"where a part of it changed, ddprun says so and falls back to torchrun's behaviour."]
    return []


@dataclasses.dataclass(frozen=True)
class TorchFeatures:
    """What a torch release offers ddprun, by the table of what was verified (see each use)."""

    version: str
    store_implementation: str  # "libuv" or "legacy": the TCPStore that can serve a held socket
    launcher_handles_signals: bool  # LaunchConfig.signals_to_handle (else torch takes SIGHUP, SIGQUIT)
    launcher_shutdown_timeout: bool  # LaunchConfig.shutdown_timeout (else torch waits 30 s)
    shared_store_switch: bool  # DISABLE_SHARED_STORE_ENV is read
    # The trainer starts warm by default. Verified on 2.14.1 (48 warm runs of its many-bucket
    # shared-memory test under load: none hung). On 2.4.0, 3 of 48 such runs left rank 1 in
    # destroy_process_group for good (fresh: 0 of 24). Not run on the releases between: fresh.
    warm_trainer_by_default: bool


def features_for(text: str) -> TorchFeatures:
    version = parse_version(text)
    return TorchFeatures(
        version=text,
        store_implementation="libuv" if version >= _LIBUV_LISTEN_FD_SINCE else "legacy",
        launcher_handles_signals=version >= (2, 10),
        launcher_shutdown_timeout=version >= (2, 12),
        shared_store_switch=version >= (2, 5),
        warm_trainer_by_default=version >= _WARM_TRAINER_VERIFIED,
    )


# --- a store served on a socket ddprun holds ------------------------------------------------
# Verified: 2.4.0 and 2.14.1 (legacy on 2.4-2.7, libuv from 2.8).


class HeldStoreUnsupported(Exception):
    """This torch's TCPStore cannot serve a socket ddprun holds: torch's own rendezvous must do."""


def serve_store_on_socket(sock_fd: int, *, host: str, port: int, implementation: str) -> Any:
    """A multi-tenant TCPStore server on an already-listening socket (`master_listen_fd`).

    libuv from 2.8; before that libuv refuses the socket and the legacy store takes it. A torch
    that refuses both raises HeldStoreUnsupported, and the caller falls back to torch's own
    rendezvous on a free port."""
    import torch.distributed as dist

    def make(use_libuv: bool) -> Any:
        return dist.TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                             master_listen_fd=sock_fd, use_libuv=use_libuv)

    if implementation == "libuv":
        try:
            return make(True)
        except (NotImplementedError, TypeError):
            pass  # the plan's table was wrong for this build: the legacy store may still serve it
    try:
        return make(False)
    except (TypeError, NotImplementedError) as error:  # a keyword or a backend this torch dropped
        raise HeldStoreUnsupported(f"{type(error).__name__}: {error}") from error


def store_owns_socket(implementation: str) -> bool:
    """The legacy store polls the fd it was given until the process ends: closing it under the
    store aborts the process ("Unexpected poll revent on the master's listening socket")."""
    return implementation == "legacy"


# --- the workers' store ---------------------------------------------------------------------
# Verified: 2.4.0 and 2.14.1. torch hands each worker MASTER_ADDR/MASTER_PORT through the
# environments it passes to LogsSpecs.reify, then starts the workers with those same mappings.


def point_workers_at(envs: Mapping[int, dict], *, host: str, port: int, agent_store: bool) -> None:
    """Every worker's MASTER_ADDR:MASTER_PORT is host:port. With `agent_store`, every rank connects
    to that store as a client (torch's own agent-store protocol: TORCHELASTIC_USE_AGENT_STORE),
    instead of rank 0 hosting one on every interface; without it rank 0 serves the store there
    itself (torchrun's --master-port on one node, as under plain torchrun or python)."""
    for env in envs.values():
        env["MASTER_ADDR"] = host
        env["MASTER_PORT"] = str(port)
        env["TORCHELASTIC_USE_AGENT_STORE"] = str(agent_store)


def keep_worker_store_local(handler: Any, create_server: Callable[[str, int], Any], *, name: str) -> bool:
    """Multi-node jobs: torch's c10d handler makes node 0's worker store with TCPStore(addr, 0),
    listening on every interface; hand it `create_server` instead (bound to one address).

    Read from the wheels: 2.5 to 2.14 have both hooks; 2.4 has neither (its workers' rank 0 hosts the store).
    Returns False where the hooks are missing: torch's behaviour, stated by the caller."""
    if not all(hasattr(handler, hook) for hook in ("_create_tcp_store_server", "_backend_name")):
        return False
    handler._create_tcp_store_server = create_server
    handler._backend_name = name  # the registry checks that the handler answers to its name
    return True


# --- the launch configuration ---------------------------------------------------------------
# Read from the wheels: signals_to_handle and LogsDest.filtered_* since 2.10, shutdown_timeout
# since 2.12. Before 2.10, torch's workers' context takes SIGHUP and SIGQUIT itself (stops the job).
# Verified by launches: 2.4.0 (neither field) and 2.14.1 (both).


def configure_launch(config: Any, *, grace_period_s: float, torch_signals: str) -> list[str]:
    """Set what LaunchConfig offers; return one line per part this torch lacks."""
    fields = {f.name for f in dataclasses.fields(config)}
    lost = []
    if "shutdown_timeout" in fields:
        config.shutdown_timeout = int(round(grace_period_s))
    elif grace_period_s != 30:
        lost.append(f"this torch waits its own 30 s, not --grace-period {grace_period_s:g}, before killing the workers")
    if "signals_to_handle" in fields:
        config.signals_to_handle = torch_signals
    return lost


def tune_logs_dest(dest: Any) -> None:
    """Ranks outside --ranks: torch >= 2.10 asks where their filtered console copy goes."""
    for name in ("filtered_stdout", "filtered_stderr"):
        if hasattr(dest, name):
            setattr(dest, name, os.devnull)


# --- the error file -------------------------------------------------------------------------
# torch's ErrorHandler.record_exception format, read back by ProcessFailure. Verified: 2.4.0, 2.14.1.


def error_record(exc: BaseException, *, now: float) -> dict:
    """The JSON torch's `@record` writes, plus a millisecond timestamp.

    torch reads only message.extraInfo.timestamp (whole seconds); ranks failing within the
    same second are ordered by the extra `timestamp_ms` key.
    """
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                "timestamp": str(int(now)),
                "timestamp_ms": str(int(now * 1000)),
            },
        }
    }


def plain_excepthook() -> Callable[..., Any]:
    """The installed excepthook, except torch.distributed's: it prefixes every line with
    [rankN]: and the launcher already prefixes each line with [rank N]."""
    hook = sys.excepthook
    return sys.__excepthook__ if getattr(hook, "__name__", "") == "_distributed_excepthook" else hook


# --- leaving without the interpreter's teardown ---------------------------------------------


def run_exit_handlers() -> None:
    """Run the atexit handlers now (CPython's atexit._run_exitfuncs, present since 3.0), before an
    os._exit that skips the teardown. Without it, the handlers are skipped, not the exit."""
    import atexit

    run = getattr(atexit, "_run_exitfuncs", None)
    if run is not None:
        run()
