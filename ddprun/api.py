"""ddprun from Python and notebooks: a function or a script on every rank, with the CLI's guarantees.

    import ddprun
    ddprun.launch(fn, x, nproc=2, cpu=True)      # [fn(x) on rank 0, fn(x) on rank 1]
    ddprun.run_script("train.py", ["--lr", "0.1"], gpus=2)
    ddprun.plan("train.py", cpu=True)            # the dry run: a LaunchPlan, nothing started

The plan is built here by the CLI's own planner (localplan.plan_here) from the same
LaunchOptions, so a bad argument raises UsageError, with the CLI's message, before anything
starts. The job then runs in a launcher process of its own (`python -m ddprun.jobprocess`),
which does what the CLI's process does: launch.execute(plan) with the held loopback store,
device checks, OMP threads, subreaper and watchdog (no orphans), per-rank logs and restarts.

Why a launcher process, not this one: the launcher is a child subreaper that stops every
process below it when the job ends (in a notebook, every process the kernel had started), a
second Ctrl-C leaves it with os._exit (it would end the kernel), and it sets the workers'
variables in its own os.environ. In a process of its own, none of that touches the caller.
A KeyboardInterrupt here (Ctrl-C, Jupyter's stop button) is passed on as SIGINT: the first
stops the workers gracefully, a second kills them; either way it is raised here once the
launcher is gone. If the caller dies, the launcher gets SIGTERM and stops the job.

Functions: fn and args are serialised by value with cloudpickle (a function defined in a
notebook cell or in __main__ travels whole, with what it refers to; one from an importable
module travels by reference, and the ranks get the caller's sys.path to import it), written
0600 to the job's private folder, and run by `ddprun.worker.call` on every rank, a fresh
process (torch's spawn, never fork). So CUDA initialised in the caller cannot hang a rank;
each rank initialises its own. Return values come back through cloudpickle: return CPU values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Mapping, Sequence

from ddprun import cluster, jobprocess, localplan, preflight, report, runfolders
from ddprun.envnames import CALL_FILE_ENV
from ddprun.errors import DdprunError, UsageError
from ddprun.plan import Entrypoint, LaunchOptions, LaunchPlan

CALL_MODULE = "ddprun.worker.call"  # the launcher's rooms name it, never import it
CALL_FILE = "call.pkl"
RESULT_NAME = "result_rank{rank}.pkl"  # as worker/call.py writes them
# LaunchOptions fields that are not options one passes: the CLI's records of how a flag was given.
_NOT_OPTIONS = {"entrypoint", "cluster", "labels", "torchrun"}
_CLUSTER_OPTIONS = ("nnodes", "node_rank", "master", "rdzv_endpoint", "rdzv_id")
# The option's Python name -> what it must be; anything else LaunchOptions has passes as given.
_KINDS: dict[str, tuple[type, ...]] = {
    "nproc": (int,), "gpus": (int, str, list, tuple), "cpu": (bool,), "max_restarts": (int,),
    "keep_logs": (int,), "port": (int,), "node_rank": (int,), "nnodes": (int, str), "log_dir": (str, os.PathLike),
    "grace_period": (int, float), "join_timeout": (int, float), "stall_timeout": (int, float),
    "forward_signals": (list, tuple), "ranks": (list, tuple),
}
_JOIN_OUTPUT_S = 5.0  # the launcher's watchdog may hold its stderr a moment after it exits


class JobFailed(DdprunError):
    """A rank failed. Carries what the failure panel shows; str() is that panel in plain text.

    rank, exc_type, exc_message, user_frame ("file.py:12 in fn"), stderr_tail (its last lines
    on stderr) describe the root-cause rank; `failures` has every failed rank
    (report.RankFailure), `exit_code` is the CLI's exit code for it, `log_dir` the job's logs.
    """

    def __init__(self, failures: Sequence[report.RankFailure], *, panel: str, log_dir: str) -> None:
        cause = report.root_cause(failures)
        super().__init__(panel)
        self.failures = list(failures)
        self.root_cause = cause
        self.rank = cause.rank
        self.exc_type = cause.exc_type
        self.exc_message = cause.exc_message
        self.user_frame = cause.user_frame
        self.stderr_tail = cause.stderr_tail
        self.exit_code = report.exit_code_for(cause)
        self.log_dir = log_dir

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple:  # picklable, e.g. across a multiprocessing pool
        return (_rebuild_job_failed, (self.failures, self.message, self.log_dir))


def _rebuild_job_failed(failures: list, panel: str, log_dir: str) -> JobFailed:
    return JobFailed(failures, panel=panel, log_dir=log_dir)


# --- the public functions ---------------------------------------------------------------------


def launch(fn: Callable[..., Any], *args: Any, **options: Any) -> list[Any]:
    """Run fn(*args) on every rank, with the rank's environment as torchrun sets it (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...). Returns what fn returned on each rank of this
    node, in rank order; raises JobFailed when a rank fails, UsageError for bad arguments
    (before anything starts), KeyboardInterrupt after a stop.

    Options, as the CLI's flags: nproc, gpus, cpu, max_restarts, log_dir, grace_period, port,
    keep_logs, ranks, join_timeout, forward_signals, nnodes, node_rank, master, rdzv_endpoint,
    rdzv_id, warm_start (True: ranks forked from a server that imported torch once), and any
    newer launch option by its name. Keyword arguments for fn: functools.partial.
    """
    if not callable(fn):
        raise UsageError(f"ddprun.launch: {fn!r} is not callable; pass the function to run on every rank, "
                         "e.g. ddprun.launch(train, nproc=2)")
    job = _plan(Entrypoint(CALL_MODULE, (), is_module=True), options)
    call = _serialised(fn, args)
    with _job_folder(job) as folder:
        path = os.path.join(folder, CALL_FILE)
        jobprocess.write_private(path, call)
        _carry_out(job, folder, env={CALL_FILE_ENV: path})
        return _results(folder, job)


def run_script(path_or_module: str, args: Sequence[str] = (), *, module: bool = False, **options: Any) -> int:
    """Run a script (or, with module=True, a module) on every rank, as `ddprun run` does.
    Returns 0; raises JobFailed when a rank fails, UsageError for bad arguments."""
    if isinstance(args, (str, bytes)) or not all(isinstance(a, str) for a in args):
        raise UsageError(f"ddprun.run_script: args must be a list of strings, e.g. [\"--lr\", \"0.1\"], not {args!r}")
    entrypoint = preflight.check_entrypoint(Entrypoint(os.fspath(path_or_module), tuple(args), is_module=module))
    job = _plan(entrypoint, options)
    with _job_folder(job) as folder:
        _carry_out(job, folder, env={})
    return 0


def plan(target: Callable[..., Any] | str, args: Sequence[str] = (), *, module: bool = False, **options: Any) -> LaunchPlan:
    """The LaunchPlan for launch(target) (a callable) or run_script(target, args): the dry run,
    nothing started. Same options as launch()."""
    if callable(target):
        return _plan(Entrypoint(CALL_MODULE, (), is_module=True), options)
    entrypoint = preflight.check_entrypoint(Entrypoint(os.fspath(target), tuple(args), is_module=module))
    return _plan(entrypoint, options)


# --- planning: the CLI's planner, from Python values --------------------------------------------


def _plan(entrypoint: Entrypoint, options: Mapping[str, Any]) -> LaunchPlan:
    return localplan.plan_here(launch_options(entrypoint, options), warn=_warn)


def _warn(notice: str) -> None:
    print(f"ddprun: warning: {notice}", file=sys.stderr)


def launch_options(entrypoint: Entrypoint, options: Mapping[str, Any]) -> LaunchOptions:
    """LaunchOptions from keyword arguments named as the CLI's flags (grace_period, not
    grace_period_s). Range checks are build_plan's, so the messages are the CLI's."""
    fields = {f.name for f in dataclasses.fields(LaunchOptions)} - _NOT_OPTIONS
    values: dict[str, Any] = {}
    flags: dict[str, Any] = {}
    for name, value in options.items():
        if value is None:
            continue
        _check_kind(name, value)
        if name in _CLUSTER_OPTIONS:
            flags[name] = str(value) if name == "nnodes" else value
        elif name in fields or f"{name}_s" in fields:
            values[name if name in fields else f"{name}_s"] = _converted(name, value)
        else:
            known = sorted({f.removesuffix("_s") for f in fields} | set(_CLUSTER_OPTIONS))
            raise UsageError(f"ddprun: unknown option {name}=...; the options are: {', '.join(known)}")
    return LaunchOptions(entrypoint=entrypoint, cluster=cluster.ClusterFlags(**flags), **values)


def _check_kind(name: str, value: Any) -> None:
    kinds = _KINDS.get(name)
    if kinds and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
        wanted = " or ".join(k.__name__ for k in kinds)
        raise UsageError(f"ddprun: {name}={value!r}: expected {wanted}")


def _converted(name: str, value: Any) -> Any:
    if name == "gpus":
        return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    if name == "log_dir":
        return preflight.check_log_dir(os.fspath(value))
    if name == "forward_signals":
        return tuple(str(s).upper() for s in value)
    if name == "ranks":
        return tuple(value)
    if name in ("grace_period", "join_timeout", "stall_timeout"):
        return float(value)
    return value


def _serialised(fn: Callable[..., Any], args: tuple) -> bytes:
    """fn and args by value (cloudpickle), and the caller's sys.path, for worker/call.py."""
    try:
        call = _dumps((fn, args))
    except Exception as error:  # a lock, an open file, a CUDA stream: what no process can receive
        raise UsageError(f"ddprun.launch: cannot send {getattr(fn, '__name__', fn)!r} and its arguments to the "
                         f"ranks: {type(error).__name__}: {error}",
                         hint="create such objects inside the function, on each rank") from None
    return pickle.dumps({"sys_path": [p for p in sys.path if isinstance(p, str)], "call": call})


def _dumps(value: Any) -> bytes:
    """cloudpickle, except that code objects travel whole (marshal: the same interpreter loads
    them): cloudpickle renames their file "<dynamic-code>", and a failure panel needs the real
    file:line of the user's function (a notebook cell's file, a script's path)."""
    import io
    import marshal
    import types
    from collections import ChainMap

    import cloudpickle

    class _Pickler(cloudpickle.Pickler):
        dispatch_table = ChainMap({types.CodeType: lambda code: (marshal.loads, (marshal.dumps(code),))},
                                  cloudpickle.Pickler.dispatch_table)

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(value)
    return buffer.getvalue()


# --- running: the job folder, the launcher process, its outcome -----------------------------------


@contextlib.contextmanager
def _job_folder(job: LaunchPlan) -> Iterator[str]:
    """The job's private folder, as the CLI makes it; the call, plan and results leave it with
    the job (the per-rank logs stay, as after `ddprun run`)."""
    runfolders.make_job_folder(job.log_dir, private_root=job.private_log_root, keep=job.keep_logs)
    try:
        yield job.log_dir
    finally:
        for name in os.listdir(job.log_dir):
            if ".pkl" in name or name == jobprocess.ERROR_FILE:  # a rank stopped mid-write leaves a .pkl.<pid>.tmp
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(job.log_dir, name))


def _carry_out(job: LaunchPlan, folder: str, *, env: Mapping[str, str]) -> None:
    """Run the launcher process; return when the job succeeded, else raise what it says."""
    jobprocess.write_private(os.path.join(folder, jobprocess.PLAN_FILE), pickle.dumps(job))
    argv = [sys.executable, "-m", "ddprun.jobprocess", folder, str(os.getpid())]
    with _output() as (stdout, stderr):
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                   env=_launcher_env(os.environ, extra=env), start_new_session=True)
        code, interrupted = _wait(process)
    if interrupted:
        raise KeyboardInterrupt
    if code != 0:
        raise _outcome(folder, code=code, job=job)


def _wait(process: subprocess.Popen) -> tuple[int, bool]:
    """Wait for the launcher. Each KeyboardInterrupt here becomes one SIGINT there: the first
    stops the workers gracefully, a second kills them (ddprun.signals)."""
    interrupted = False
    try:
        while True:
            try:
                return process.wait(), interrupted
            except KeyboardInterrupt:
                interrupted = True
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGINT)
    finally:
        if process.poll() is None:  # anything else ended the wait: stop the job, leave nothing behind
            process.terminate()
            process.wait()


def _launcher_env(environ: Mapping[str, str], *, extra: Mapping[str, str]) -> dict[str, str]:
    """The caller's environment, with this very ddprun importable (a source tree on sys.path)."""
    package_parent = str(Path(__file__).resolve().parents[1])
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if package_parent not in paths:
        paths.append(package_parent)
    return {**environ, "PYTHONPATH": os.pathsep.join(paths), **extra}


def _outcome(folder: str, *, code: int, job: LaunchPlan) -> Exception:
    failure = os.path.join(folder, jobprocess.FAILURE_FILE)
    if os.path.exists(failure):
        with open(failure, "rb") as source:
            record = pickle.load(source)
        return JobFailed(record["failures"], panel=record["panel"], log_dir=job.log_dir)
    error = os.path.join(folder, jobprocess.ERROR_FILE)
    if os.path.exists(error):
        import json

        with open(error) as source:
            record = json.load(source)
        kind = UsageError if record["exit_code"] == UsageError.exit_code else DdprunError
        return kind(record["message"], hint=record["hint"])
    name = report.signal_name(128 - code) if code > 128 else None
    why = f"was stopped by {name}" if name else f"exited with code {code}"
    return DdprunError(f"the job's launcher {why}; its messages are above, every rank's output is in {job.log_dir}")


def _results(folder: str, job: LaunchPlan) -> list[Any]:
    """What fn returned, in rank order: every rank of a one-node job, else this node's ranks."""
    import cloudpickle  # noqa: F401  (results made by cloudpickle load with pickle once it is importable)

    found = {}
    for name in os.listdir(folder):
        if name.startswith("result_rank") and name.endswith(".pkl"):
            found[int(name[len("result_rank"):-len(".pkl")])] = os.path.join(folder, name)
    if job.world_size is not None and job.nnodes == "1" and sorted(found) != list(range(job.world_size)):
        missing = sorted(set(range(job.world_size)) - set(found))
        raise DdprunError(f"the job ended without the return value of rank(s) {', '.join(map(str, missing))}; "
                          f"see {job.log_dir}")
    values = []
    for rank in sorted(found):
        with open(found[rank], "rb") as source:
            values.append(pickle.load(source))
    return values


@contextlib.contextmanager
def _output() -> Iterator[tuple[Any, Any]]:
    """The launcher's stdout and stderr: this process's own files when they are real ones, else
    (Jupyter, captured streams) pipes whose lines are copied into sys.stdout and sys.stderr."""
    direct = _real_fds()
    if direct is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        yield direct
        return
    readers = []
    with contextlib.ExitStack() as stack:
        ends = []
        for stream_name in ("stdout", "stderr"):
            read_fd, write_fd = os.pipe()
            reader = os.fdopen(read_fd, "rb")
            stack.callback(reader.close)
            thread = threading.Thread(target=_copy_lines, args=(reader, stream_name), daemon=True,
                                      name=f"ddprun-{stream_name}")
            thread.start()
            readers.append(thread)
            ends.append(write_fd)
        try:
            yield tuple(ends)
        finally:
            for fd in ends:
                os.close(fd)  # the launcher has its own copies; ours would keep the pipes open
        for thread in readers:
            thread.join(_JOIN_OUTPUT_S)


def _copy_lines(reader: IO[bytes], stream_name: str) -> None:
    for line in reader:
        stream = getattr(sys, stream_name)
        stream.write(line.decode("utf-8", errors="replace"))
        stream.flush()


def _real_fds() -> tuple[int, int] | None:
    if "ipykernel" in sys.modules:  # its streams have fds, but the notebook shows only what is written to them
        return None
    try:
        return sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return None
