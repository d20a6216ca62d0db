"""The ddprun command line: parse, call pure functions, render, exit.

This is the one place where a DdprunError becomes a message and an exit code.
torch is never imported here: --help and --dry-run stay instant.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from ddprun import cluster, config, localplan, preflight, torch_internals, torchrun_compat, runfolders
from ddprun.errors import DdprunError, UsageError
from ddprun.plan import DEFAULT_GRACE_PERIOD_S, Entrypoint, LaunchOptions, LaunchPlan

app = typer.Typer(
    name="ddprun",
    help="Launch PyTorch DistributedDataParallel jobs that work the first time.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion: bash, zsh, fish (Typer's own)
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
stderr = Console(stderr=True, highlight=False, emoji=False)  # user text stays literal: ":x:" is no emoji

PASSTHROUGH = {"allow_interspersed_args": False, "ignore_unknown_options": True}

# --- options shared by every command that launches a job ------------------------------------

Gpus = Annotated[Optional[str], typer.Option("--gpus", metavar="N|all|0,2", envvar="DDPRUN_GPUS", help="GPUs to use: a count N (the first N visible), 'all', or ordinals among the visible GPUs like 0,2. Default: all visible GPUs. The flag wins over DDPRUN_GPUS.", show_default=False)]
Cpu = Annotated[bool, typer.Option("--cpu", help="Run CPU processes on gloo, even where GPUs exist.")]
Nproc = Annotated[Optional[str], typer.Option("--nproc", "--nproc-per-node", "--nproc_per_node", metavar="N|auto|gpu|cpu", envvar="DDPRUN_NPROC", help="Processes per node (torchrun's --nproc-per-node): a count, or auto (the GPUs, else one per core), gpu, cpu (one per core). Default: the number of selected GPUs, or 2 on CPU. Above 4 per core on CPU needs --force.", show_default=False)]
Port = Annotated[Optional[str], typer.Option("--port", metavar="PORT", envvar="DDPRUN_PORT", help="Rendezvous port of a single-node job, bound and held by ddprun (not torchrun's --master-port, which is the workers' MASTER_PORT). Default: a free port.", show_default=False)]
Nnodes = Annotated[Optional[str], typer.Option("--nnodes", metavar="N|MIN:MAX", help="Number of nodes N, or MIN:MAX for an elastic job. Detected under SLURM and Kubeflow; the flag wins.", show_default=False)]
NodeRank = Annotated[Optional[str], typer.Option("--node-rank", "--node_rank", metavar="R", help="This node's rank, 0 <= R < N, with --master.", show_default=False)]
Master = Annotated[Optional[str], typer.Option("--master", metavar="HOST:PORT", help="HOST:PORT of node 0, for a fixed set of nodes (every node runs the same command).", show_default=False)]
RdzvEndpoint = Annotated[Optional[str], typer.Option("--rdzv-endpoint", "--rdzv_endpoint", metavar="HOST:PORT", help="HOST:PORT of the c10d store, for an elastic job.", show_default=False)]
RdzvId = Annotated[Optional[str], typer.Option("--rdzv-id", "--rdzv_id", metavar="ID", help="Rendezvous id shared by all nodes of a job. Default: unique per job.", show_default=False)]
MaxRestarts = Annotated[str, typer.Option("--max-restarts", "--max_restarts", metavar="N", envvar="DDPRUN_MAX_RESTARTS", help="Restart the workers up to N times when one fails.")]
LogDir = Annotated[Optional[str], typer.Option("--log-dir", "--log_dir", metavar="DIR", envvar="DDPRUN_LOG_DIR", help="Keep every rank's stdout and stderr in DIR/<job id>/, a new private folder per job. Default: DIR is your private ddprun folder ($XDG_RUNTIME_DIR/ddprun, else <temp dir>/ddprun-<uid>). The newest --keep-logs job folders stay in DIR; ddprun deletes only its own older job folders. The flag wins over DDPRUN_LOG_DIR.", show_default=False)]
KeepLogs = Annotated[str, typer.Option("--keep-logs", metavar="N", envvar="DDPRUN_KEEP_LOGS", help="Job folders ddprun keeps in the log folder, this job's included; older ones it made are deleted (0: keep all). The flag wins over DDPRUN_KEEP_LOGS.")]
Ranks = Annotated[Optional[str], typer.Option("--ranks", metavar="RANKS", help="Global ranks whose output reaches the console, e.g. 0,3 (the log files keep all).", show_default=False)]
GracePeriod = Annotated[str, typer.Option("--grace-period", "--shutdown-timeout", "--shutdown_timeout", metavar="SECONDS", envvar="DDPRUN_GRACE_PERIOD", help="Seconds the workers get to exit after Ctrl-C or SIGTERM before they are killed.")]
JoinTimeout = Annotated[Optional[str], typer.Option("--join-timeout", metavar="SECONDS", help="Seconds to wait for all nodes to join before failing. Default: torch's 600.", show_default=False)]
ForwardSignal = Annotated[Optional[List[str]], typer.Option("--forward-signal", metavar="SIGNAL", help="Forward SIGUSR1, SIGUSR2 or SIGHUP to the workers (scheduler preemption notices). Repeatable.", show_default=False)]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Start nothing: print the equivalent torchrun command on stdout.")]
AsJson = Annotated[bool, typer.Option("--json", help="With --dry-run: print the plan as JSON.")]
StallTimeout = Annotated[Optional[str], typer.Option("--stall-timeout", metavar="SECONDS", envvar="DDPRUN_STALL_TIMEOUT", help="Report a job in which no rank advanced for SECONDS (no new output, no progress, the same stacks): print every rank's stacks once, with the word stalled. Default: off. The flag wins over DDPRUN_STALL_TIMEOUT.", show_default=False)]
OnStall = Annotated[str, typer.Option("--on-stall", metavar="report|kill", help="What a stall does: report (print the stacks, keep waiting) or kill (also end the job, exit 1).")]


# --- torchrun's own options, with torchrun's meaning (see ddprun.torchrun_compat) ----------------


def _torchrun(*names: str, metavar: str | None = None, help: str) -> typer.models.OptionInfo:
    return typer.Option(*names, metavar=metavar, help=help, show_default=False)


Standalone = Annotated[bool, _torchrun("--standalone", help="torchrun's: a one-node job on its own store (ddprun's default).")]
RdzvBackend = Annotated[Optional[str], _torchrun("--rdzv-backend", "--rdzv_backend", metavar="c10d|static", help="torchrun's rendezvous backend.")]
RdzvConf = Annotated[Optional[str], _torchrun("--rdzv-conf", "--rdzv_conf", metavar="K=V,...", help="torchrun's rendezvous settings, e.g. last_call_timeout=5,join_timeout=60.")]
MasterAddr = Annotated[Optional[str], _torchrun("--master-addr", "--master_addr", metavar="HOST", help="torchrun's: on one node (with --master-port) the workers' MASTER_ADDR; on many, node 0's address.")]
MasterPort = Annotated[Optional[str], _torchrun("--master-port", "--master_port", metavar="PORT", help="torchrun's: on one node the workers' MASTER_PORT (rank 0 serves it); on many, node 0's port.")]
LocalAddr = Annotated[Optional[str], _torchrun("--local-addr", "--local_addr", metavar="HOST", help="torchrun's: this node's address (many nodes).")]
NoPython = Annotated[bool, _torchrun("--no-python", "--no_python", help="torchrun's: execute SCRIPT as a program, not with python.")]
RunPath = Annotated[bool, _torchrun("--run-path", "--run_path", help="torchrun's: run SCRIPT with runpy.run_path (what ddprun always does).")]
Redirects = Annotated[Optional[str], _torchrun("-r", "--redirects", metavar="N|L:N,...", help="torchrun's: keep these streams (1 out, 2 err, 3 both) off the console; the log files keep all.")]
Tee = Annotated[Optional[str], _torchrun("-t", "--tee", metavar="N|L:N,...", help="torchrun's: show and keep these streams (ddprun always keeps files).")]
LocalRanksFilter = Annotated[Optional[str], _torchrun("--local-ranks-filter", "--local_ranks_filter", metavar="0,1", help="torchrun's: local ranks whose output reaches the console.")]
PrefixTemplate = Annotated[Optional[str], _torchrun("--log-line-prefix-template", "--log_line_prefix_template", metavar="TEMPLATE", help="torchrun's console line prefix: ${rank}, ${local_rank}, ${role_name}, ${hostname}. Default: '[rank ${rank}] '.")]
MonitorInterval = Annotated[Optional[str], _torchrun("--monitor-interval", "--monitor_interval", metavar="SECONDS", help="torchrun's: how often torch checks the workers.")]
StartMethod = Annotated[Optional[str], _torchrun("--start-method", "--start_method", metavar="spawn|fork|forkserver", help="torchrun's.")]
EventLogHandler = Annotated[Optional[str], _torchrun("--event-log-handler", "--event_log_handler", metavar="NAME", help="torchrun's.")]
Role = Annotated[Optional[str], _torchrun("--role", metavar="NAME", help="torchrun's: the workers' role name.")]
LogsSpecs = Annotated[Optional[str], _torchrun("--logs-specs", "--logs_specs", metavar="NAME", help="torchrun's; refused (ddprun writes the logs).")]
NumaBinding = Annotated[Optional[str], _torchrun("--numa-binding", "--numa_binding", metavar="MODE", help="torchrun's.")]
SignalsToHandle = Annotated[Optional[str], _torchrun("--signals-to-handle", "--signals_to_handle", metavar="SIGNALS", help="torchrun's: signals that stop the job, e.g. SIGTERM,SIGINT,SIGUSR1.")]
VirtualLocalRank = Annotated[bool, _torchrun("--virtual-local-rank", "--virtual_local_rank", help="torchrun's.")]
DupStdout = Annotated[Optional[str], _torchrun("--duplicate-stdout-filters", "--duplicate_stdout_filters", metavar="FILTERS", help="torchrun's.")]
DupStderr = Annotated[Optional[str], _torchrun("--duplicate-stderr-filters", "--duplicate_stderr_filters", metavar="FILTERS", help="torchrun's.")]
PrintCompletion = Annotated[Optional[str], _torchrun("--print-completion", "--print_completion", metavar="SHELL", help="torchrun's; refused.")]
TtyRank = Annotated[Optional[str], _torchrun("--tty-rank", metavar="R", help="In a terminal, the rank whose stdin/stdout/stderr are the terminal itself (tqdm, colours, breakpoint()). Default: 0.")]
Force = Annotated[bool, typer.Option("--force", help="Allow more than 4 CPU processes per core.")]
WarmStart = Annotated[Optional[bool], typer.Option("--warm-start/--fresh-start", envvar="DDPRUN_WARM_START", help="--warm-start: fork every rank from a per-node server that imported torch once (faster starts and restarts; see README for what differs). --fresh-start: a new Python process per rank, as torchrun. Default: warm for `ddprun train`, fresh for `ddprun run`. The flag wins over DDPRUN_WARM_START.", show_default=False)]


def _given(ctx: typer.Context, values: dict) -> dict[str, torchrun_compat.Given]:
    """Each option's raw text and how it was given: flag, DDPRUN_* variable, torchrun's PET_* variable."""
    params = {p.name: p for p in ctx.command.params if p.name in values and p.param_type_name == "option"}
    sources = {name: {"COMMANDLINE": "flag", "ENVIRONMENT": "env"}.get(getattr(ctx.get_parameter_source(name), "name", ""), "default")
               for name in params}
    flags = {name: next((o for o in p.opts if o.startswith("--")), p.opts[0]) for name, p in params.items()}
    envvars = {name: p.envvar for name, p in params.items() if isinstance(getattr(p, "envvar", None), str)}
    env = torchrun_compat.pet_env(os.environ, scheduler=cluster.detect_scheduler(os.environ))
    return torchrun_compat.given_values({n: values[n] for n in params}, sources=sources, flags=flags, envvars=envvars, env=env)


def _known_options(ctx: typer.Context) -> list[str]:
    return [name for p in ctx.command.params for name in getattr(p, "opts", []) if name.startswith("-")]


def _launch_options(entrypoint: Entrypoint, flags: dict, given: dict | None = None) -> LaunchOptions:
    """Turn the raw strings of the shared options into validated LaunchOptions. `given` (see _given):
    each option's text and source; a PET_* variable fills what no flag or DDPRUN_* variable set."""
    given = _with_file_labels(flags.get("ctx"), given or {}, flags)
    flags = {**flags, **{k: g.text for k, g in given.items() if isinstance(flags.get(k), (str, type(None)))}}

    def at(name: str, flag: str) -> str:  # how an error names the value: the flag or the variable
        return given[name].label if name in given and given[name].label else flag

    return LaunchOptions(
        entrypoint=entrypoint,
        gpus=preflight.check_gpus(flags["gpus"], flag=at("gpus", "--gpus")),
        cpu=flags["cpu"],
        nproc=torchrun_compat.parse_nproc(torchrun_compat.Given(flags["nproc"], at("nproc", "--nproc"))),
        port=cluster.parse_port(flags["port"], flag=at("port", "--port")) if flags["port"] is not None else None,
        cluster=cluster.ClusterFlags(
            nnodes=flags["nnodes"],
            node_rank=preflight.parse_int(flags["node_rank"], flag=at("node_rank", "--node-rank"), example="0"),
            master=flags["master"],
            rdzv_endpoint=flags["rdzv_endpoint"],
            rdzv_id=flags["rdzv_id"],
            labels=tuple((k, given[k].label) for k in ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id")
                         if k in given and given[k].label),
        ),
        max_restarts=preflight.parse_int(flags["max_restarts"], flag=at("max_restarts", "--max-restarts"), example="2"),
        log_dir=preflight.check_log_dir(flags["log_dir"]),
        keep_logs=preflight.parse_int(flags["keep_logs"], flag=at("keep_logs", "--keep-logs"), example="100"),
        ranks=preflight.parse_ranks(flags["ranks"]),
        grace_period_s=preflight.parse_seconds(flags["grace_period"], flag=at("grace_period", "--grace-period")),
        join_timeout_s=preflight.parse_seconds(flags["join_timeout"], flag="--join-timeout"),
        forward_signals=tuple(s.upper() for s in flags["forward_signal"] or ()),
        force=bool(flags.get("force")),
        tty_rank=preflight.parse_int(flags.get("tty_rank"), flag="--tty-rank", example="0"),
        torchrun=torchrun_compat.choices(given) if given else torchrun_compat.TorchrunChoices(),
        labels={k: g.label for k, g in given.items() if g.label},
        stall_timeout_s=preflight.parse_seconds(flags["stall_timeout"], flag="--stall-timeout"),
        on_stall=flags["on_stall"],
        warm_start=flags.get("warm_start"),
    )


def _plan(options: LaunchOptions, *, terminal: bool = False) -> LaunchPlan:
    inputs = {"terminal": terminal} if terminal else {}
    return localplan.plan_here(options, warn=_warn, **inputs)  # ddprun.launch() plans through it too


def _warn(notice: str) -> None:
    stderr.print(f"[bold yellow]ddprun: warning:[/] {escape(notice)}", soft_wrap=True)


def _with_file_labels(ctx: typer.Context | None, given: dict, values: dict) -> dict:
    """`given` plus, for each option whose value came from the config file (click's default_map,
    not overridden by a PET_* variable), the file and key: "pyproject.toml [tool.ddprun] nproc".
    The plan's source map shows it, and a bad value's message names it."""
    found = ctx.find_object(config.ConfigFile) if ctx is not None else None
    if found is None:
        return given
    labelled = dict(given)
    for param in ctx.command.params:
        if not param.name or getattr(ctx.get_parameter_source(param.name), "name", "") != "DEFAULT_MAP":
            continue
        if param.name in given and given[param.name].label:
            continue  # torchrun's PET_* variable: the environment wins over the file
        text = given[param.name].text if param.name in given else config.as_text(values.get(param.name))
        labelled[param.name] = torchrun_compat.Given(text, found.key_label(ctx.info_name, param.name, param.opts))
    return labelled


def _launch_or_print(plan: LaunchPlan, *, dry_run: bool, as_json: bool) -> int:
    if as_json and not dry_run:
        raise UsageError("--json goes with --dry-run, e.g. ddprun run train.py --dry-run --json")
    if dry_run:
        print(plan.to_json() if as_json else plan.shell_command())
        if plan.launch.lost_in_torchrun_line and not as_json:
            stderr.print(f"ddprun: note: run by hand, this torchrun line loses "
                         f"{escape('; '.join(plan.launch.lost_in_torchrun_line))}. --json shows what ddprun does.", soft_wrap=True)
        return 0
    from ddprun import panels, warmstart

    runfolders.make_job_folder(plan.log_dir, private_root=plan.private_log_root, keep=plan.keep_logs)
    warm = warmstart.start(plan, environ=os.environ, say=panels.sayer(stderr))  # importing while we do
    from ddprun import launch

    code = launch.execute(plan, console=stderr, warm=warm, announce=lambda: stderr.print(panels.render_plan(plan)))
    # The job is over and reported. Tearing down an interpreter that imported torch takes
    # over half a second and has nothing left to do: leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --- commands -------------------------------------------------------------------------------


def _print_version(value: bool) -> None:
    if value:
        from importlib import metadata

        try:
            own = metadata.version("ddprun")
        except metadata.PackageNotFoundError:  # run from a source tree
            from ddprun import __version__ as own
        print(f"ddprun {own}\ntorch {torch_internals.installed_torch_version() or 'not installed'}\n"
              f"Python {sys.version.split()[0]}")
        raise typer.Exit(0)


def _apply_config(ctx: typer.Context) -> None:
    """Defaults from [tool.ddprun] (pyproject.toml) or ddprun.toml, as click's default_map: a
    flag, then a DDPRUN_* variable, win over the file. Keys are checked against the options."""
    found = config.find(Path.cwd())
    if found is None:
        return
    specs = {
        name: [config.OptionSpec(p.name, tuple(o.lstrip("-").replace("-", "_") for o in p.opts if o.startswith("--")),
                                 "flag" if p.is_flag else "multiple" if p.multiple else "value")
               for p in command.params if p.param_type_name == "option" and p.name]
        for name, command in ctx.command.commands.items()
    }
    ctx.default_map = config.default_map(found, specs)
    ctx.obj = found  # the launch commands name it as the source of its values


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version, help="Print the versions of ddprun, torch and Python, and exit.")] = False,
) -> None:
    """Launch PyTorch DistributedDataParallel jobs that work the first time.

    \b
      ddprun train --gpus 2           the bundled DDP trainer
      ddprun run train.py -- --lr 0.1 any script, launched properly
      ddprun doctor                   is this machine ready for DDP?
    """
    _apply_config(ctx)


@app.command(context_settings=PASSTHROUGH)
def run(
    ctx: typer.Context,
    script: Annotated[str, typer.Argument(metavar="SCRIPT", help="The script to run (or, with -m, the module). Everything after it is passed to it unchanged.", show_default=False)],
    script_args: Annotated[Optional[List[str]], typer.Argument(metavar="[ARGS]...", help="Arguments for the script.", show_default=False)] = None,
    module: Annotated[bool, typer.Option("-m", "--module", help="Run SCRIPT as a module, like python -m.")] = False,
    standalone: Standalone = False, rdzv_backend: RdzvBackend = None, rdzv_conf: RdzvConf = None,
    master_addr: MasterAddr = None, master_port: MasterPort = None, local_addr: LocalAddr = None,
    no_python: NoPython = False, run_path: RunPath = False, redirects: Redirects = None, tee: Tee = None,
    local_ranks_filter: LocalRanksFilter = None, log_line_prefix_template: PrefixTemplate = None,
    monitor_interval: MonitorInterval = None, start_method: StartMethod = None, event_log_handler: EventLogHandler = None,
    role: Role = None, logs_specs: LogsSpecs = None, numa_binding: NumaBinding = None, signals_to_handle: SignalsToHandle = None,
    virtual_local_rank: VirtualLocalRank = False, duplicate_stdout_filters: DupStdout = None,
    duplicate_stderr_filters: DupStderr = None, print_completion: PrintCompletion = None,
    tty_rank: TtyRank = None, force: Force = False,
    gpus: Gpus = None, cpu: Cpu = False, nproc: Nproc = None, port: Port = None,
    nnodes: Nnodes = None, node_rank: NodeRank = None, master: Master = None,
    rdzv_endpoint: RdzvEndpoint = None, rdzv_id: RdzvId = None,
    max_restarts: MaxRestarts = "0", log_dir: LogDir = None, keep_logs: KeepLogs = str(runfolders.DEFAULT_KEEP), ranks: Ranks = None,
    grace_period: GracePeriod = f"{DEFAULT_GRACE_PERIOD_S:g}", join_timeout: JoinTimeout = None, forward_signal: ForwardSignal = None,
    stall_timeout: StallTimeout = None, on_stall: OnStall = "report", warm_start: WarmStart = None,
    dry_run: DryRun = False, as_json: AsJson = False,
) -> None:
    """Run any script (or module) on every rank, launched properly. torchrun's options work too, with torchrun's meaning."""
    given = _given(ctx, dict(locals()))
    entrypoint = preflight.check_entrypoint(
        Entrypoint(script, preflight.script_args(script_args), is_module=torchrun_compat.switch(given["module"]),
                   no_python=torchrun_compat.switch(given["no_python"]) and not torchrun_compat.switch(given["run_path"])),
        known_options=_known_options(ctx))
    options = _launch_options(entrypoint, dict(locals()), given)
    terminal = sys.stdin.isatty() and sys.stderr.isatty()
    raise typer.Exit(_launch_or_print(_plan(options, terminal=terminal), dry_run=dry_run, as_json=as_json))


def _trainer_help() -> str:
    from ddprun import train_options

    return "\b\nTraining options (passed to every rank):\n" + train_options.options_help()


class _TrainCommand(typer.core.TyperCommand):
    """Completes the trainer's options and their values too (`--model res<TAB>`): they reach the
    command as extra arguments, which Typer's completion cannot see (ddprun.completion)."""

    def shell_complete(self, ctx: typer.Context, incomplete: str) -> list:
        from typer.core import CompletionItem

        from ddprun.completion import trainer_completions

        extra = [CompletionItem(value, help=help) for value, help in trainer_completions(ctx.args, incomplete)]
        return super().shell_complete(ctx, incomplete) + extra


@app.command(
    cls=_TrainCommand,
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    epilog=_trainer_help(),
)
def train(
    ctx: typer.Context,
    gpus: Gpus = None, cpu: Cpu = False, nproc: Nproc = None, port: Port = None,
    nnodes: Nnodes = None, node_rank: NodeRank = None, master: Master = None,
    rdzv_endpoint: RdzvEndpoint = None, rdzv_id: RdzvId = None,
    max_restarts: MaxRestarts = "0", log_dir: LogDir = None, keep_logs: KeepLogs = str(runfolders.DEFAULT_KEEP), ranks: Ranks = None,
    grace_period: GracePeriod = f"{DEFAULT_GRACE_PERIOD_S:g}", join_timeout: JoinTimeout = None, forward_signal: ForwardSignal = None,
    stall_timeout: StallTimeout = None, on_stall: OnStall = "report", warm_start: WarmStart = None,
    dry_run: DryRun = False, as_json: AsJson = False,
) -> None:
    """Train an image classifier with the bundled DDP trainer (resnet18 on synthetic data by default)."""
    from ddprun import train_options

    trainer = train_options.parse_cli(ctx.args)
    train_options.validate(trainer)  # the trainer's own checks need no plan: they come first
    flags = dict(locals())
    entrypoint = Entrypoint(train_options.WORKER_MODULE, tuple(train_options.to_argv(trainer)), is_module=True,
                            bundled=True)
    plan = _plan(_launch_options(entrypoint, flags))
    train_options.validate(trainer, world_size=plan.world_size)
    raise typer.Exit(_launch_or_print(plan, dry_run=dry_run, as_json=as_json))


@app.command()
def doctor(
    no_smoke: Annotated[bool, typer.Option("--no-smoke", help="Skip the live all-reduce test.")] = False,
    max_bytes: Annotated[Optional[str], typer.Option("--max-bytes", metavar="SIZE", help="Largest all-reduce of the bandwidth sweep, e.g. 64M or 1G. Default: 64M on CPU, 1G on GPU.", show_default=False)] = None,
    timeout: Annotated[str, typer.Option("--timeout", metavar="SECONDS", help="Seconds after which a hung smoke test is stopped and reported.")] = "60",
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 on warnings too.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the checks and the bandwidth table as JSON on stdout.")] = False,
) -> None:
    """Is this machine ready for DDP? Versions, GPUs, NCCL, /dev/shm, ports, network, and a live all-reduce."""
    from ddprun.doctor import checks
    from ddprun.doctor.main import run_doctor

    code = run_doctor(
        smoke=not no_smoke,
        max_bytes=checks.parse_size(max_bytes) if max_bytes else None,
        timeout_s=preflight.parse_seconds(timeout, flag="--timeout"),
        strict=strict,
        as_json=as_json,
        console=stderr,
    )
    raise typer.Exit(code)


@app.command()
def stacks(
    job: Annotated[Optional[str], typer.Argument(metavar="[JOB]", help="A job id (ddprun-...) or a job folder (DIR/<job id>). Default: your only running job.", show_default=False)] = None,
    native: Annotated[bool, typer.Option("--native", help="Also show every rank's native stack through py-spy (py-spy must be installed).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the stacks as JSON on stdout.")] = False,
) -> None:
    """Where is every rank of a running job? All threads' stacks, grouped; the job keeps running."""
    import shutil

    from ddprun import stacks as stack_tools

    if native and not shutil.which("py-spy"):
        raise UsageError("--native needs py-spy on PATH: pip install py-spy")
    folder = stack_tools.find_job(job, roots=stack_tools.search_roots(os.environ), uid=os.getuid())
    attempt = stack_tools.latest_attempt(folder)
    if attempt is None:
        stderr.print(f"ddprun: {escape(folder.name)} has not started its workers yet.")
        raise typer.Exit(0)
    snapshot = stack_tools.collect(attempt, native=native)
    if as_json:
        print(stack_tools.to_json(snapshot))
    else:
        stderr.print(f"ddprun: {escape(folder.name)}, {attempt.name}: {len(snapshot)} rank(s) on this node")
        Console(highlight=False, soft_wrap=True).print(stack_tools.render(snapshot))


@app.command(context_settings=PASSTHROUGH)
def sbatch(
    command: Annotated[List[str], typer.Argument(metavar="COMMAND...", help="The ddprun command every node runs, e.g. train --epochs 10 (after --).", show_default=False)],
    nodes: Annotated[str, typer.Option("--nodes", "-N", metavar="N", help="Number of nodes.")] = "1",
    gpus_per_node: Annotated[str, typer.Option("--gpus-per-node", metavar="G", help="GPUs per node (0 for CPU nodes).")] = "8",
    time: Annotated[Optional[str], typer.Option("--time", "-t", metavar="TIME", help="Time limit, e.g. 04:00:00 or 1-00:00:00.", show_default=False)] = None,
    partition: Annotated[Optional[str], typer.Option("--partition", "-p", metavar="NAME", help="SLURM partition.", show_default=False)] = None,
    account: Annotated[Optional[str], typer.Option("--account", "-A", metavar="NAME", help="SLURM account.", show_default=False)] = None,
    job_name: Annotated[str, typer.Option("--job-name", "-J", metavar="NAME", help="Job name.")] = "ddprun",
    cpus_per_task: Annotated[Optional[str], typer.Option("--cpus-per-task", "-c", metavar="N", help="CPU cores per node for ddprun and its workers.", show_default=False)] = None,
    output: Annotated[Optional[str], typer.Option("--output", "-o", metavar="PATTERN", help="Log file pattern. Default: %x-%j.out", show_default=False)] = None,
) -> None:
    """Print an sbatch script that runs a ddprun command on N nodes (one ddprun per node, via srun)."""
    from ddprun.sbatch import check_inner_command, render_sbatch

    inner = preflight.script_args(command)
    check_inner_command(inner, parse=_parse_inner)

    print(render_sbatch(
        nodes=preflight.parse_int(nodes, flag="--nodes", example="2"),
        gpus_per_node=preflight.parse_int(gpus_per_node, flag="--gpus-per-node", example="8"),
        ddprun_args=inner,
        job_name=job_name, time=time, partition=partition, account=account,
        cpus_per_task=preflight.parse_int(cpus_per_task, flag="--cpus-per-task", example="32"),
        output=output,
    ), end="")


def _parse_inner(args: list[str]) -> None:
    """Parse `ddprun run|train ...` as each node will, without planning (this is not the cluster)."""
    group = typer.main.get_command(app)
    command = group.get_command(typer.Context(group), args[0])
    try:
        ctx = command.make_context(args[0], list(args[1:]))
    except typer.TyperException as err:  # click's own errors (typer bundles click)
        raise UsageError(getattr(err, "format_message", lambda: str(err))()) from None
    if args[0] == "train":
        from ddprun import train_options

        train_options.validate(train_options.parse_cli(ctx.args))
    elif ctx.params["script"].startswith("-"):
        raise torchrun_compat.unknown_option(ctx.params["script"], known=_known_options(ctx))
    flags = {**ctx.params, "log_dir": None}  # the log folder is the cluster's, not this machine's
    _launch_options(Entrypoint(args[0]), flags, _given(ctx, flags))  # every value parses as it will there


def main() -> None:
    """Console entry point: the only place a DdprunError becomes a message and an exit code."""
    try:
        app()
    except DdprunError as error:
        if os.environ.get("DDPRUN_DEBUG") == "1":
            raise
        stderr.print(f"[bold red]ddprun: error:[/] {escape(error.message)}")
        if error.hint:
            stderr.print(f"  [dim]hint:[/] {escape(error.hint)}")
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        stderr.print("[bold red]ddprun:[/] interrupted.")
        sys.exit(130)
