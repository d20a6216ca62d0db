"""Warm start: the node's fork server, started before the launcher's own torch import.

The plan decides whether a job starts warm (LaunchChoices.warm_start) and what the server
imports (warm_preload). Here the launcher starts the server (ddprun/worker/warmserver.py, by
module name: the launcher's rooms never import the worker's), tells every rank's client where
it listens at each start of the workers, and stops it when the job ends.

Falling back is always safe: a rank whose environment has no socket, or whose server is gone,
execs the ordinary fresh bootstrap. When the server cannot start or has died, the launcher says
so in one line and the next start of the workers is fresh.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
from typing import Callable, Iterator, Mapping

from ddprun.envnames import LAUNCHER_PID_ENV, WARM_SOCKET_ENV
from ddprun.plan import BOOTSTRAP_MODULE, LaunchPlan

SERVER_MODULE = "ddprun.worker.warmserver"
_STOP_WAIT_S = 2.0
SOCKET_NAME = "warm.sock"
# Variables torch or its OpenMP/MKL runtime may read when imported. A script that sets one in
# os.environ before `import torch` would find it already read by the warm server.
_PREFIXES = r"(?:TORCH|PYTORCH|OMP|MKL|KMP|GOMP)_\w+"
_SETS_IMPORT_TIME_VAR = re.compile(
    rf"""os\.(?:environ\s*\[\s*['"]({_PREFIXES})['"]\s*\]\s*=(?!=)"""
    rf"""|(?:environ\.setdefault|putenv)\(\s*['"]({_PREFIXES})['"]"""
    rf"""|environ\.update\([^)]*?\b({_PREFIXES})\b)""")


def import_time_settings(source: str) -> list[str]:
    """The import-time variables a script's text sets in os.environ, e.g. os.environ["TORCH_LOGS"] = ..."""
    return sorted({name for names in _SETS_IMPORT_TIME_VAR.findall(source) for name in names if name})


def _script_of(plan: LaunchPlan) -> str | None:
    args = plan.torchrun_args[plan.torchrun_args.index(BOOTSTRAP_MODULE) + 1:]
    return args[0] if args and args[0] not in ("-m", "--no-python") else None


def _settings_in_script(plan: LaunchPlan) -> tuple[str, list[str]] | None:
    script = _script_of(plan)
    if script is None:
        return None
    try:
        with open(script, errors="replace") as f:
            names = import_time_settings(f.read())
    except OSError:
        return None
    return (script, names) if names else None


class WarmServer:
    def __init__(self, process: subprocess.Popen | None, *, socket_path: str, log_path: str, why: str = "") -> None:
        self.process, self.socket_path, self.log_path, self.why = process, socket_path, log_path, why
        self.warned = False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def prepare(self, envs: dict[int, dict[str, str]], *, say: Callable[[str], None]) -> None:
        """At each start of the workers: point their clients at the server, or say once that it is gone."""
        if self.alive():
            for env in envs.values():
                env[WARM_SOCKET_ENV] = self.socket_path
            return
        if not self.warned:
            self.warned = True
            say(f"warning: warm start unavailable ({self._failure()}); starting fresh worker processes")

    def _failure(self) -> str:
        if self.why:
            return self.why
        code = self.process.returncode if self.process is not None else None
        return f"its server ended with code {code}, see {self.log_path}"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(_STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)


def start(plan: LaunchPlan, *, environ: Mapping[str, str], say: Callable[[str], None]) -> WarmServer | None:
    """The server, importing in the background; None when the job starts fresh processes.

    Its environment is the one every rank shares (the launcher's, plus the plan's), so what
    torch reads at import time is what a fresh rank would have read. A script that sets such a
    variable itself starts fresh, with a note.
    """
    if not plan.launch.warm_start:
        return None
    found = _settings_in_script(plan)
    if found is not None:
        say(f"note: {found[0]} sets {', '.join(found[1])} in os.environ, which torch may read when imported; "
            "warm start imports torch before the script runs, so this job starts fresh processes (--fresh-start: no note)")
        return None
    # In the job's private (0700) folder, however deep (worker/unixsocket.py): nothing is left
    # anywhere else, even after a kill -9.
    socket_path = os.path.join(plan.log_dir, SOCKET_NAME)
    log_path = os.path.join(plan.log_dir, "warm_server.log")
    env = {**environ, **plan.env, **plan.launch.launcher_env, LAUNCHER_PID_ENV: str(os.getpid())}
    argv = [sys.executable, "-u", "-m", SERVER_MODULE, "--socket", socket_path,
            "--parent-pid", str(os.getpid()), "--preload", ",".join(plan.launch.warm_preload)]
    server = functools.partial(WarmServer, socket_path=socket_path, log_path=log_path)
    try:
        with open(log_path, "ab", opener=lambda path, flags: os.open(path, flags, 0o600)) as log:
            process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                       start_new_session=True)
    except OSError as error:
        return server(None, why=f"could not start its server: {error}")
    return server(process)


@contextlib.contextmanager
def serving(server: WarmServer | None) -> Iterator[WarmServer | None]:
    """Stopped when the job ends, before the reaper looks for what the job left."""
    try:
        yield server
    finally:
        if server is not None:
            server.stop()
