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
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Callable, Iterator, Mapping

from ddprun.envnames import LAUNCHER_PID_ENV, WARM_SOCKET_ENV
from ddprun.plan import LaunchPlan

SERVER_MODULE = "ddprun.worker.warmserver"
_STOP_WAIT_S = 2.0


class WarmServer:
    def __init__(self, process: subprocess.Popen | None, *, folder: str, log_path: str, why: str = "") -> None:
        self.process, self.folder, self.log_path, self.why = process, folder, log_path, why
        self.socket_path = os.path.join(folder, "s")
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
        shutil.rmtree(self.folder, ignore_errors=True)


def start(plan: LaunchPlan, *, environ: Mapping[str, str]) -> WarmServer | None:
    """The server, importing in the background; None when the plan starts fresh processes.

    Its environment is the one every rank shares (the launcher's, plus the plan's), so what
    torch reads at import time is what a fresh rank would have read.
    """
    if not plan.launch.warm_start:
        return None
    folder = tempfile.mkdtemp(prefix="ddprun-warm-")  # 0700, and short: a socket path has 107 bytes
    log_path = os.path.join(plan.log_dir, "warm_server.log")
    env = {**environ, **plan.env, **plan.launch.launcher_env, LAUNCHER_PID_ENV: str(os.getpid())}
    argv = [sys.executable, "-u", "-m", SERVER_MODULE, "--socket", os.path.join(folder, "s"),
            "--parent-pid", str(os.getpid()), "--preload", ",".join(plan.launch.warm_preload)]
    try:
        with open(log_path, "ab") as log:
            process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                       start_new_session=True)
    except OSError as error:
        return WarmServer(None, folder=folder, log_path=log_path, why=f"could not start its server: {error}")
    return WarmServer(process, folder=folder, log_path=log_path)


@contextlib.contextmanager
def serving(server: WarmServer | None) -> Iterator[WarmServer | None]:
    """Stopped when the job ends, before the reaper looks for what the job left."""
    try:
        yield server
    finally:
        if server is not None:
            server.stop()
