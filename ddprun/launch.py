"""Run a LaunchPlan with torch's own machinery, in this process: torchrun's parser and config, then elastic_launch.

torch is imported here, lazily, so the CLI stays instant for --help and --dry-run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from rich.console import Console

from ddprun import gcpause, live, panels, reaper, warmstart, rendezvous, report, signals, stall, torch_internals, torchrun_compat
from ddprun.deaths import DeathWatch, rank_of
from ddprun.envnames import LAUNCHER_PID_ENV
from ddprun.errors import DdprunError
from ddprun.plan import BOOTSTRAP_MODULE, LOOPBACK, WARM_CLIENT_MODULE, LaunchPlan

_ELASTIC_LOGGER = "torch.distributed.elastic"


@dataclass
class _Rendezvous:
    torchrun_args: list[str]
    held: rendezvous.HeldStore | None


def execute(plan: LaunchPlan, *, console: Console, warm: warmstart.WarmServer | None,
            announce: Callable[[], None] = lambda: None,
            on_failure: Callable[[list, Any], None] = lambda failures, panel: None) -> int:
    """Launch the job and return ddprun's exit code. Raises UsageError if the port is taken.

    `warm`: the fork server (warm start), started by the caller before it imported this module
    (warmstart.start), so that its torch import overlaps this process's; None: fresh ranks.

    `announce` runs once the rendezvous port is held, just before the workers start.
    `on_failure(failures, panel)` gets the failed ranks (report.RankFailure) and the panel shown
    (ddprun.api raises them as JobFailed).
    """
    say = panels.sayer(console)
    # Imported before the loggers are tuned: torch sets each module logger's level on import.
    with gcpause.paused():
        import torch.distributed.run  # noqa: F401
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    sys.stdout.reconfigure(line_buffering=True)  # ranks' lines reach a pipe as they come
    os.environ.update({**plan.env, **plan.launch.launcher_env})
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    with reaper.job_reaper(grace_period_s=plan.grace_period_s, say=say), warmstart.serving(warm), \
            DeathWatch() as deaths, _quiet_torch_logs(), \
            _held_rendezvous(plan, say=say) as rdzv, _join_watch(plan, rdzv, say=say) as watch:
        restarts = _Restarts(say=say, deaths=deaths, join_watch=watch)
        launcher, logs = _build_launcher(plan, rdzv, on_start=restarts.on_start, say=say, warm=warm)
        restarts.logs = logs
        hangs = stall.HangWatch(plan, console=console, say=say, attempt=lambda: logs.current)
        deaths.on_death = hangs.on_death  # exit codes for `ddprun stacks`; a sample when a rank fails
        announce()
        show_progress = live.progress_bar(console, path=os.path.join(plan.log_dir, "progress.jsonl"))

        def graceful_stop(sig: signal.Signals) -> None:
            if sig == signal.SIGINT and logs.current is not None:
                hangs.show_interrupted()  # where every rank was, before they are stopped
            raise SignalException(f"ddprun got {sig.name}", sigval=sig)

        with signals.handling(forward=plan.forward_signals, graceful_stop=graceful_stop,
                              workers_started=lambda: logs.current is not None, say=say), show_progress, hangs:
            try:
                launcher()
                return 0
            except ChildFailedError as failed:
                return _report_failure(failed, plan=plan, logs=logs, console=console, notes=hangs.failure_notes,
                                       on_failure=on_failure)
            except SignalException as stopped:
                if hangs.ended_stalled:
                    say("stopped: the job stalled (--on-stall kill); the workers were stopped too.")
                    return 1
                say(f"stopped by {stopped.sigval.name}; the workers were stopped too.")
                return 128 + int(stopped.sigval)
            except Exception as error:
                _raise_if_join_failed(error, watch=watch, logs=logs)
                raise


@contextlib.contextmanager
def _held_rendezvous(plan: LaunchPlan, *, say: Callable[[str], None]) -> Iterator[_Rendezvous]:
    """Hold the store's socket for the job's life when this node serves it; yield the torchrun
    args with the port actually held."""
    host, port = rendezvous.split_endpoint(plan.endpoint)
    address = rendezvous.local_address(host) if plan.store_role != "client" else None
    if address is None:
        if plan.store_role == "host":
            raise DdprunError(f"{host} is not an address of this machine, so node 0's store cannot listen there")
        yield _Rendezvous(plan.torchrun_args, None)
        return
    flag = "--port" if plan.nnodes == "1" else plan.source.get("endpoint", "--master")
    with contextlib.ExitStack() as stack:
        try:
            held = stack.enter_context(rendezvous.hold_store(
                address, port, flag=flag, implementation=plan.launch.store_implementation))
        except torch_internals.HeldStoreUnsupported as why:
            say(f"note: this torch cannot serve a store on a socket ddprun holds ({why}); torch's own "
                "rendezvous runs it instead, without a held port, a loopback-only store or a fresh store per restart.")
            held = None
        except rendezvous.PortTakenError:
            if plan.launch.store_port_fallback:  # a loopback --rdzv-endpoint on one node: any free port does
                held = stack.enter_context(rendezvous.hold_store(
                    address, 0, flag=flag, implementation=plan.launch.store_implementation))
                say(f"port {port} is in use, so this job's store holds port {held.port} instead")
            elif plan.store_role == "host":
                raise
            else:
                # c10d: another process on this machine serves this endpoint: join it, as torchrun does.
                say(f"{plan.endpoint} is served by another process on this machine: joining it")
                held = None
        if held is None:
            yield _Rendezvous(plan.torchrun_args, None)
        else:
            real = rendezvous.with_port(plan.endpoint, held.port)
            yield _Rendezvous([real if arg == plan.endpoint else arg for arg in plan.torchrun_args], held)


@contextlib.contextmanager
def _join_watch(plan: LaunchPlan, rdzv: _Rendezvous, *, say: Callable[[str], None]) -> Iterator[Any]:
    """Multi-node jobs only: a visible wait for the other nodes, and a count for the timeout."""
    if plan.nnodes == "1":
        yield None
        return
    watch = rendezvous.JoinWatch(
        endpoint=plan.endpoint, rdzv_id=plan.rdzv_id, nnodes=plan.nnodes, timeout_s=plan.join_timeout_s,
        say=say, store=rdzv.held.store if rdzv.held else None,
    )
    with watch:
        yield watch


def _build_launcher(plan: LaunchPlan, rdzv: _Rendezvous, *, on_start: Callable[[int, int], None],
                    say: Callable[[str], None], warm: warmstart.WarmServer | None = None):
    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    from ddprun.logs import RankLogsSpecs

    # torchrun's argparse rejects user arguments that abbreviate its own options (a script's
    # --nproc "could match --nproc-per-node"), so only the launcher's part goes through it.
    split = rdzv.torchrun_args.index(BOOTSTRAP_MODULE) + 1
    with torchrun_compat.pet_variables_hidden():  # read and checked by ddprun already; the args say it all
        config, entrypoint, entrypoint_args = torchrun.config_from_args(torchrun.parse_args(rdzv.torchrun_args[:split]))
    entrypoint_args = [*entrypoint_args, *rdzv.torchrun_args[split:]]
    if warm is not None:  # each rank's process is the small client; it execs the bootstrap when cold
        entrypoint_args[entrypoint_args.index(BOOTSTRAP_MODULE)] = WARM_CLIENT_MODULE
    choices = plan.launch
    stores = rendezvous.WorkerStores(bind_host=rdzv.held.host if rdzv.held else LOOPBACK,
                                     implementation=choices.store_implementation, say=say)

    def on_attempt(number: int, envs: dict[int, dict[str, str]]) -> None:
        on_start(number, config.max_restarts)
        if warm is not None:
            warm.prepare(envs, say=say)
        if choices.fresh_worker_store and rdzv.held is not None:
            stores.fresh_for(envs)
        elif choices.workers_master:
            host, port = rendezvous.split_endpoint(choices.workers_master)
            torch_internals.point_workers_at(envs, host=host, port=port, agent_store=False)

    logs = RankLogsSpecs(
        plan.log_dir, console_ranks=set(plan.ranks) if plan.ranks is not None else None, on_attempt=on_attempt,
        console=plan.console,
    )
    config.logs_specs = logs
    config.log_line_prefix_template = plan.console.prefix_template
    for line in torch_internals.configure_launch(
            config, grace_period_s=plan.grace_period_s, torch_signals=",".join(choices.torch_signals)):
        say(f"note: {line}")
    if rdzv.held is not None:
        config.rdzv_configs["is_host"] = False  # torch's agent joins the store ddprun holds
        if choices.local_worker_store_hook and config.rdzv_backend == "c10d":
            config.rdzv_backend = rendezvous.register_backend(stores)
    return (lambda: elastic_launch(config, entrypoint)(*entrypoint_args)), logs


def _report_failure(failed: Any, *, plan: LaunchPlan, logs: Any, console: Console,
                    notes: Callable[[list], list] = lambda failures: [],
                    on_failure: Callable[[list, Any], None] = lambda failures, panel: None) -> int:
    attempt = logs.current
    stderr_logs = {rank: attempt.stderr_log(rank) for rank in attempt.global_ranks.values()} if attempt else {}
    failures = report.failures_from_torch(failed.failures, stderr_logs=stderr_logs)
    panel = report.render_failure(failures, log_location=plan.log_dir, attempt=attempt.number if attempt else None,
                                  notes=notes(failures))
    console.print(panel)
    on_failure(failures, panel)
    return report.exit_code_for(report.root_cause(failures), bundled_worker=plan.bundled_worker)


def _raise_if_join_failed(error: Exception, *, watch: Any, logs: Any) -> None:
    """A rendezvous that timed out before any worker started becomes one clear message."""
    from torch.distributed import DistStoreError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    if watch is None or logs.current is not None:
        return
    if isinstance(error, (RendezvousError, DistStoreError, TimeoutError)):
        raise DdprunError(
            watch.timeout_message(),
            hint="start the same command on every node (each with its own --node-rank), check that the "
            "port is open between the nodes, or wait longer with --join-timeout",
        ) from error


# --- restarts and torch's log records ----------------------------------------------------------


class _Restarts:
    """Each start of the workers: the first ends the join wait, a later one is a restart.

    Noticed through the attempt number torch gives every start (TORCHELASTIC_RESTART_COUNT in
    the workers' environments), never through torch's log text. Why it restarted comes from
    ddprun's own DeathWatch, since torch's record names the wrong rank whenever failures share
    a second.
    """

    def __init__(self, *, say: Callable[[str], None], deaths: DeathWatch, join_watch: Any) -> None:
        self.say, self.deaths, self.join_watch = say, deaths, join_watch
        self.logs: Any = None  # RankLogsSpecs, for the previous attempt's pid files

    def on_start(self, number: int, max_restarts: int) -> None:
        if self.join_watch is not None:
            self.join_watch.started()
        if number > 0:
            self.say(f"restart {number}/{max_restarts}: {self._reason()}")

    def _reason(self) -> str:
        attempt = self.logs.current if self.logs else None
        death = self.deaths.first_failure_since(attempt.started_at) if attempt else None
        if death is None:
            return "a worker failed"
        rank = rank_of(death.pid, attempt.directory)
        who = f"rank {rank}" if rank is not None else f"worker pid {death.pid}"
        name = report.signal_name(death.exitcode)
        return f"{who} was killed by {name}" if name else f"{who} exited with code {death.exitcode}"


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch elastic's records stay out of the console (ddprun says what matters in its own
    lines); DDPRUN_DEBUG=1 lets them through as they are."""
    elastic = logging.getLogger(_ELASTIC_LOGGER)
    saved = elastic.propagate
    quiet = logging.NullHandler()
    elastic.addHandler(quiet)  # without a handler, Python's last resort prints warnings to stderr
    elastic.propagate = os.environ.get("DDPRUN_DEBUG") == "1"
    try:
        yield
    finally:
        elastic.removeHandler(quiet)
        elastic.propagate = saved
