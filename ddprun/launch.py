"""Run a LaunchPlan with torch's own machinery, in this process: torchrun's parser and config, then elastic_launch.

torch is imported here, lazily, so the CLI stays instant for --help and --dry-run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from typing import Callable, Iterator

from rich.console import Console

from ddprun import rendezvous, report
from ddprun.plan import BOOTSTRAP_MODULE, LaunchPlan
from ddprun.worker.bootstrap import LAUNCHER_PID_ENV

# torch handles these by stopping the workers with the same signal; ddprun handles SIGINT
# and SIGTERM itself (so that a second one kills at once) and forwards what the user asked.
_TORCH_HANDLED = ("SIGHUP", "SIGQUIT")
_ELASTIC_LOGGER = "torch.distributed.elastic"
# torch sets each module logger to WARNING; the agent's restart record is INFO.
_AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"


def execute(plan: LaunchPlan, *, console: Console, announce: Callable[[], None] = lambda: None) -> int:
    """Launch the job and return ddprun's exit code. Raises UsageError if the port is taken.

    `announce` runs once the rendezvous port is held, just before the workers start.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    sys.stdout.reconfigure(line_buffering=True)  # ranks' lines reach a pipe as they come
    os.environ.update(plan.env)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    with _quiet_torch_logs() as restarts, _held_rendezvous(plan) as torchrun_args:
        launcher, logs = _build_launcher(plan, torchrun_args)
        restarts.console, restarts.logs = console, logs
        announce()
        with _signal_handling(plan, console=console):
            try:
                launcher()
                return 0
            except ChildFailedError as failed:
                return _report_failure(failed, plan=plan, logs=logs, console=console)
            except SignalException as stopped:
                return _report_signal(stopped.sigval, console=console)


@contextlib.contextmanager
def _held_rendezvous(plan: LaunchPlan) -> Iterator[list[str]]:
    """Hold the store's socket for the job's life; yield the torchrun args with the real port."""
    if not plan.host_store:
        yield plan.torchrun_args
        return
    host, port = _split_endpoint(plan.endpoint)
    flag = "--port" if host == "127.0.0.1" else "--master"
    with rendezvous.hold_store(host, port, flag=flag) as held:
        real = f"{plan.endpoint.rsplit(':', 1)[0]}:{held.port}"
        yield [real if arg == plan.endpoint else arg for arg in plan.torchrun_args]


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.rsplit(":", 1)
    return host.strip("[]"), int(port)


def _build_launcher(plan: LaunchPlan, torchrun_args: list[str]):
    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    from ddprun.logs import LINE_PREFIX_TEMPLATE, RankLogsSpecs

    # torchrun's argparse rejects user arguments that abbreviate its own options (a script's
    # --nproc "could match --nproc-per-node"), so only the launcher's part goes through it.
    split = torchrun_args.index(BOOTSTRAP_MODULE) + 1
    config, entrypoint, entrypoint_args = torchrun.config_from_args(torchrun.parse_args(torchrun_args[:split]))
    entrypoint_args = [*entrypoint_args, *torchrun_args[split:]]
    single_node = plan.host_store and plan.nnodes == "1"
    logs = RankLogsSpecs(
        plan.log_dir,
        console_ranks=set(plan.ranks) if plan.ranks is not None else None,
        on_attempt=rendezvous.fresh_worker_store if single_node else lambda number, envs: None,
    )
    config.logs_specs = logs
    config.log_line_prefix_template = LINE_PREFIX_TEMPLATE
    config.shutdown_timeout = int(round(plan.grace_period_s))
    config.signals_to_handle = ",".join(s for s in _TORCH_HANDLED if s not in plan.forward_signals)
    if plan.host_store and config.rdzv_backend == "c10d":
        config.rdzv_backend = rendezvous.register_backend(bind_host=_split_endpoint(plan.endpoint)[0])
    return (lambda: elastic_launch(config, entrypoint)(*entrypoint_args)), logs


def _report_failure(failed, *, plan: LaunchPlan, logs, console: Console) -> int:
    attempt = logs.current
    stderr_logs = {rank: attempt.stderr_log(rank) for rank in attempt.global_ranks.values()} if attempt else {}
    failures = report.failures_from_torch(failed.failures, stderr_logs=stderr_logs)
    console.print(report.render_failure(failures, log_location=plan.log_dir, attempt=attempt.number if attempt else None))
    return report.exit_code_for(report.root_cause(failures))


def _report_signal(sig: signal.Signals, *, console: Console) -> int:
    console.print(f"[bold red]ddprun:[/] stopped by {sig.name}; the workers were stopped too.")
    return 128 + int(sig)


# --- signals -----------------------------------------------------------------------------


@contextlib.contextmanager
def _signal_handling(plan: LaunchPlan, *, console: Console) -> Iterator[None]:
    """First SIGINT/SIGTERM: stop the workers gracefully (torch sends them the same signal,
    waits the grace period, then SIGKILLs). A second one: SIGKILL everything and exit now."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    received: list[signal.Signals] = []

    def stop(signum, _frame):
        sig = signal.Signals(signum)
        if received:
            _kill_children(signal.SIGKILL)
            console.print(f"[bold red]ddprun:[/] {sig.name} again: killed the workers.")
            os._exit(128 + int(received[0]))
        received.append(sig)
        raise SignalException(f"ddprun got {sig.name}", sigval=sig)

    def forward(signum, _frame):
        _kill_children(signal.Signals(signum))

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    for name in plan.forward_signals:
        previous[getattr(signal, name)] = signal.signal(getattr(signal, name), forward)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _kill_children(sig: signal.Signals) -> None:
    """Signal this process's direct children: the workers (each in its own session)."""
    me = os.getpid()
    for pid in _child_pids(me):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _child_pids(parent: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            children.append(int(entry))
    return children


# --- torch's log records -------------------------------------------------------------------


class _ElasticEvents(logging.Handler):
    """Turns torch elastic's log records into ddprun's own lines, and silences the rest.

    torch logs a failed attempt as ("failed (exitcode: %s) local_rank: %s ...") and a restart
    as ("Worker group %s. %s/%s attempts left ..."); the record *arguments* are read, never
    the formatted text. DDPRUN_DEBUG=1 lets torch's records through as they are.
    """

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.console: Console | None = None
        self.last_failure: tuple[int, int] | None = None  # (exit code, local rank)
        self.restarts = 0
        self.logs = None  # RankLogsSpecs: maps a local rank to its global rank

    def emit(self, record: logging.LogRecord) -> None:
        msg = str(record.msg)
        if msg.startswith("failed (exitcode:") and len(record.args or ()) >= 2:
            self.last_failure = (int(record.args[0]), int(record.args[1]))
        elif "attempts left" in msg and len(record.args or ()) >= 4 and self.console:
            self.restarts += 1
            self.console.print(f"[yellow]ddprun:[/] restart {self.restarts}/{record.args[3]}: {self._reason()}")

    def _reason(self) -> str:
        if self.last_failure is None:
            return "a worker failed"
        code, local_rank = self.last_failure
        attempt = self.logs.current if self.logs else None
        rank = f"rank {attempt.global_ranks[local_rank]}" if attempt else f"local rank {local_rank}"
        name = report.signal_name(code)
        return f"{rank} was killed by {name}" if name else f"{rank} exited with code {code}"


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[_ElasticEvents]:
    events = _ElasticEvents()
    elastic = logging.getLogger(_ELASTIC_LOGGER)
    debug = os.environ.get("DDPRUN_DEBUG") == "1"
    agent = logging.getLogger(_AGENT_LOGGER)
    saved = (elastic.propagate, agent.level)
    elastic.addHandler(events)
    elastic.propagate = debug
    agent.setLevel(logging.INFO)
    try:
        yield events
    finally:
        elastic.removeHandler(events)
        elastic.propagate, _ = saved
        agent.setLevel(saved[1])
