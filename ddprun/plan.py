"""From what the user asked for to the exact torchrun invocation: a pure function and its value.

`build_plan` reads nothing from the process: the environment, the GPU inventory and the
core count are arguments, so every rule here is tested directly.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field, replace
from typing import Mapping, Sequence

from ddprun import cluster, devices, envnames, runfolders, torch_internals, torchrun_compat
from ddprun.errors import UsageError

LOOPBACK = "127.0.0.1"
LOOPBACK_IFNAME = "lo"
BOOTSTRAP_MODULE = "ddprun.worker.bootstrap"
# Warm start: what torch elastic starts per rank instead (it hands the rank to the fork server).
WARM_CLIENT_MODULE = "ddprun.worker.warmclient"
TRAINER_MODULE = "ddprun.worker.train"
# What the fork server imports once per node: what every DDP script needs; the trainer's own.
WARM_PRELOAD = ("torch", "torch.distributed")
WARM_PRELOAD_TRAINER = ("torch", "torch.distributed", "torchvision", TRAINER_MODULE)
DEFAULT_CPU_PROCS = 2
DEFAULT_GRACE_PERIOD_S = 10.0
DEFAULT_JOIN_TIMEOUT_S = 600.0  # torch's own default for both rendezvous backends
# Processes per node beyond which a count is a typo: CPU jobs, per core (--force goes past it);
# and a ceiling no --force passes (per-rank lists are built only below it).
MAX_CPU_PROCS_PER_CORE = 4
MAX_PROCS_PER_NODE = 4096
LINE_PREFIX_TEMPLATE = "[rank ${rank}] "
# What a stalled job gets (--on-stall): its stacks printed once, or also ended with exit 1.
ON_STALL_CHOICES = ("report", "kill")
# The NCCL flight recorder: each rank's last collectives, dumped into the job folder on a timeout.
FLIGHT_RECORDER_PREFIX = "nccl_trace/rank_"
# The signals a scheduler sends before preemption; forwarded to workers only on request.
FORWARDABLE_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP")


@dataclass(frozen=True)
class Entrypoint:
    """The user's code: a script path or a module name, and its arguments, passed on untouched."""

    target: str
    args: tuple[str, ...] = ()
    is_module: bool = False
    no_python: bool = False  # torchrun's --no-python: a program, executed after the worker setup
    bundled: bool = False  # ddprun's own trainer: its exit 2 is ddprun refusing bad input

    def _mode(self) -> list[str]:
        return ["-m"] if self.is_module else ["--no-python"] if self.no_python else []

    def argv(self) -> list[str]:
        return [*self._mode(), self.target, *self.args]

    def describe(self) -> str:
        return shlex.join([*self._mode(), self.target, *self.args])


@dataclass(frozen=True)
class LaunchOptions:
    """Everything the user typed that shapes the launch. None means 'not given'."""

    entrypoint: Entrypoint
    gpus: str | None = None
    cpu: bool = False
    nproc: int | str | None = None  # a count, or torchrun's "auto", "gpu", "cpu"
    port: int | None = None
    cluster: cluster.ClusterFlags = field(default_factory=cluster.ClusterFlags)
    max_restarts: int = 0
    log_dir: str | None = None
    keep_logs: int = runfolders.DEFAULT_KEEP
    ranks: tuple[int, ...] | None = None
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S
    join_timeout_s: float | None = None
    forward_signals: tuple[str, ...] = ()
    stall_timeout_s: float | None = None  # --stall-timeout: None is off
    on_stall: str = "report"  # --on-stall report|kill
    force: bool = False  # past the sanity limit on processes per node
    tty_rank: int | None = None  # the rank that gets the terminal (default 0, in a terminal)
    torchrun: torchrun_compat.TorchrunChoices = field(default_factory=torchrun_compat.TorchrunChoices)
    labels: dict[str, str] = field(default_factory=dict)  # option -> how it was given: flag, DDPRUN_*, PET_*
    warm_start: bool | None = None  # --warm-start/--fresh-start; None: the default for the entrypoint


@dataclass(frozen=True)
class ConsoleChoices:
    """What the console shows; every rank's output is in its log files regardless."""

    prefix_template: str = LINE_PREFIX_TEMPLATE
    local_ranks: list[int] | None = None  # --local-ranks-filter
    redirects: dict[int, int] | int | None = None  # torchrun's: a redirected stream leaves the console
    tee: dict[int, int] | int | None = None
    tty_rank: int | None = None  # this global rank's stdin/stdout/stderr are the launcher's terminal


@dataclass(frozen=True)
class LaunchChoices:
    """What ddprun does at launch that the torchrun line cannot express; `launch` carries it out."""

    torch_version: str
    # Where the rendezvous store listens when ddprun serves it (binds, holds for the job's life);
    # "endpoint" for a c10d job: held by the node whose address the endpoint names; None: joins.
    store_bind: str | None
    store_implementation: str  # TCPStore "libuv" or "legacy": which one takes a held socket
    agent_joins_held_store: bool  # torch's agent connects to ddprun's store (--rdzv-conf is_host=false)
    fresh_worker_store: bool  # every start of the workers gets a new store, on loopback
    local_worker_store_hook: bool  # node 0's worker store bound to the endpoint's address only
    torch_signals: list[str]  # signals torch's agent handles itself (stops the job)
    grace_period_honoured: bool  # False: this torch waits its own 30 s
    launcher_env: dict[str, str]  # set in the launcher only, for torch's agent
    launch_env: dict[str, str]  # per-rank variables set at launch: name -> what it holds
    lost_in_torchrun_line: list[str]  # guarantees the printed torchrun line would not keep
    # Ctrl-\ (SIGQUIT) prints every rank's stacks; False where torch < 2.10 takes SIGQUIT itself.
    stacks_on_sigquit: bool = False
    # An explicit loopback --rdzv-endpoint on one node: its port when free, else any free port.
    store_port_fallback: bool = False
    # torchrun's --master-port on one node: the workers' MASTER_ADDR:MASTER_PORT, served by rank 0.
    workers_master: str | None = None
    # Ranks forked from a per-node server that imported these modules once (ddprun/warmstart.py).
    warm_start: bool = False
    warm_preload: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LaunchPlan:
    torchrun_args: list[str]
    env: dict[str, str]
    nproc_per_node: int
    nnodes: str
    world_size: int | None  # None for an elastic MIN:MAX job: known only after rendezvous
    backend: str
    devices: list[str] | None
    device_labels: list[str]
    entrypoint: str
    bundled_worker: bool  # the workers are ddprun's own (ddprun train): their exit 2 stays 2
    job_id: str  # names the log folder; shown to the user
    rdzv_id: str  # secret unless the user chose it: never shown outside --dry-run
    endpoint: str
    # Who serves the rendezvous store: "host" (ddprun binds and holds it: one node, or node 0 of
    # a fixed set), "auto" (c10d: the node whose address the endpoint names), or "client".
    store_role: str
    log_dir: str  # <root>/<job id>: a folder made fresh at launch
    private_log_root: bool  # root is ddprun's per-user root (strict checks), not the user's --log-dir
    keep_logs: int  # job folders kept in root, this one included; 0 keeps all
    ranks: list[int] | None
    grace_period_s: float
    join_timeout_s: float
    forward_signals: list[str]
    notices: list[str]
    source: dict[str, str]
    launch: LaunchChoices
    stall_timeout_s: float | None = None  # report (or end) the job when no rank advanced for this long
    on_stall: str = "report"
    console: ConsoleChoices = field(default_factory=ConsoleChoices)
    user_rdzv_id: str | None = None  # an id given for a one-node job: shown, not used as the store key

    def shell_command(self) -> str:
        """One copy-pasteable line: the environment ddprun adds, then torchrun."""
        assignments = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        return " ".join([*assignments, "torchrun", *map(shlex.quote, self.torchrun_args)])

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


@dataclass(frozen=True)
class _Devices:
    backend: str
    nproc: int
    selected: list[devices.VisibleGpu] | None
    notices: list[str]


def build_plan(
    options: LaunchOptions,
    *,
    env: Mapping[str, str],
    inventory: Sequence[devices.Gpu],
    cpu_count: int,
    job_id: str,
    log_root: str,
    rdzv_secret: str,
    torch_version: str,
    terminal: bool = False,
) -> LaunchPlan:
    """Decide everything about the launch; raise UsageError for anything wrong with the request.

    `rdzv_secret` names the rendezvous when the user gave no id: torch's c10d rendezvous keeps
    its state as a pickle under that name in a store every local user can reach, so the name
    must be unguessable and shown nowhere (the job id, which names the log folder, is not it).
    A one-node job always uses it, even with --rdzv-id (kept as `user_rdzv_id`, for display).
    `terminal`: the launcher's stdin and stderr are a terminal (the console rank gets it).
    """
    _check_generic_options(options)
    features = torch_internals.features_for(torch_version)
    _check_torch_features(options, features)
    options = _resolve_nproc(options, env=env, inventory=inventory, cpu_count=cpu_count)
    chosen = _choose_devices(options, env=env, inventory=inventory)
    spec = cluster.detect_cluster(_cluster_flags(options), env)
    local = _loopback_endpoint(spec)
    spec = replace(spec, endpoint=None, rdzv_id=None) if local else spec
    workers_master = _workers_master(options, spec)
    world = _world_size(spec, chosen.nproc)
    ranks = _check_ranks(options.ranks, world)
    rdzv_id = str(spec.rdzv_id.value) if spec.rdzv_id and spec.is_multi_node() else rdzv_secret
    endpoint = _endpoint(spec, options.port or (local.value.port if local else None))
    conf, join_timeout_s = _rdzv_conf(options, spec)
    worker_env = _worker_env(chosen, env=env, cpu_count=cpu_count, multi_node=spec.is_multi_node())
    worker_env.update(_flight_recorder_env(chosen.backend, env=env, job_folder=_job_folder(options.log_dir or log_root, job_id)))
    notices = chosen.notices + _env_notices(worker_env, env=env, cpu_count=cpu_count, nproc=chosen.nproc)
    notices += _misplaced_flag_notices(options.entrypoint)
    notices += _torchrun_notices(options, spec=spec, workers_master=workers_master, join_timeout_s=join_timeout_s)
    return LaunchPlan(
        torchrun_args=_torchrun_args(options, spec=spec, nproc=chosen.nproc, rdzv_id=rdzv_id, endpoint=endpoint,
                                     conf=conf, join_timeout_s=join_timeout_s),
        env=worker_env,
        nproc_per_node=chosen.nproc,
        nnodes=spec.nnodes_text(),
        world_size=world,
        backend=chosen.backend,
        devices=[g.entry for g in chosen.selected] if chosen.selected is not None else None,
        device_labels=_device_labels(chosen),
        entrypoint=options.entrypoint.describe(),
        bundled_worker=options.entrypoint.bundled,
        job_id=job_id,
        rdzv_id=rdzv_id,
        endpoint=endpoint,
        store_role=_store_role(spec),
        log_dir=_job_folder(options.log_dir or log_root, job_id),  # never the user's folder itself
        private_log_root=options.log_dir is None,
        keep_logs=options.keep_logs,
        ranks=ranks,
        grace_period_s=options.grace_period_s,
        join_timeout_s=join_timeout_s or DEFAULT_JOIN_TIMEOUT_S,
        forward_signals=list(options.forward_signals),
        stall_timeout_s=options.stall_timeout_s,
        on_stall=options.on_stall,
        notices=notices,
        source=_sources(options, spec=spec, local=local),
        launch=replace(_launch_choices(spec, features=features, forward=options.forward_signals,
                                       grace_period_s=options.grace_period_s, workers_master=workers_master,
                                       extra_signals=options.torchrun.signals_to_handle),
                       store_port_fallback=local is not None and options.port is None,
                       **_warm_start(options, features)),
        console=_console(options, env=env, terminal=terminal, world=world),
        user_rdzv_id=str(spec.rdzv_id.value) if spec.rdzv_id and not spec.is_multi_node() else (
            options.cluster.rdzv_id if local else None),
    )


def _given(options: LaunchOptions, name: str, flag: str, value: object) -> str:
    """How the user gave it: "--nproc 0", "DDPRUN_NPROC=0" or "PET_NPROC_PER_NODE=0"."""
    return torchrun_compat.shown(options.labels.get(name, flag), str(value))


def _check_generic_options(options: LaunchOptions) -> None:
    if isinstance(options.nproc, int) and options.nproc < 1:
        raise UsageError(f"{_given(options, 'nproc', '--nproc', options.nproc)}: the number of processes per node "
                         "must be at least 1, e.g. --nproc 2")
    if isinstance(options.nproc, int) and options.nproc > MAX_PROCS_PER_NODE:
        raise UsageError(f"{_given(options, 'nproc', '--nproc', options.nproc)}: more than {MAX_PROCS_PER_NODE} "
                         "processes per node is not a launch ddprun can make; e.g. --nproc 8")
    if options.cpu and options.gpus is not None:
        raise UsageError("--cpu and --gpus exclude each other: use --cpu for CPU processes on gloo, or --gpus for GPUs on nccl")
    if options.max_restarts < 0:
        raise UsageError(f"--max-restarts {options.max_restarts}: must be 0 or more, e.g. --max-restarts 2")
    if options.keep_logs < 0:
        raise UsageError(f"--keep-logs {options.keep_logs}: must be 0 (keep all) or more, e.g. --keep-logs 100")
    if options.grace_period_s < 0:
        raise UsageError(f"--grace-period {options.grace_period_s:g}: must be 0 or more seconds, e.g. --grace-period 10")
    if options.join_timeout_s is not None and options.join_timeout_s <= 0:
        raise UsageError(f"--join-timeout {options.join_timeout_s:g}: must be more than 0 seconds, e.g. --join-timeout 300")
    for name in options.forward_signals:
        if name not in FORWARDABLE_SIGNALS:
            raise UsageError(f"--forward-signal {name}: choose from {', '.join(FORWARDABLE_SIGNALS)}")
    if options.stall_timeout_s is not None and options.stall_timeout_s <= 0:
        raise UsageError(f"--stall-timeout {options.stall_timeout_s:g}: must be more than 0 seconds, e.g. --stall-timeout 300")
    if options.on_stall not in ON_STALL_CHOICES:
        raise UsageError(f"--on-stall {options.on_stall}: choose report (print the stacks, keep waiting) or kill (end the job, exit 1)")


def _check_torch_features(options: LaunchOptions, features: torch_internals.TorchFeatures) -> None:
    if "SIGHUP" in options.forward_signals and not features.launcher_handles_signals:
        raise UsageError(f"--forward-signal SIGHUP needs torch >= 2.10: torch {features.version} stops the job "
                         "on SIGHUP itself; forward SIGUSR1 or SIGUSR2 instead")
    extra = options.torchrun.signals_to_handle
    if extra and not features.launcher_handles_signals:
        raise UsageError(f"--signals-to-handle {','.join(extra)} needs torch >= 2.10 (torch {features.version} "
                         "handles a fixed set); use --forward-signal to relay them to the workers instead")
    for name in extra:
        if name in options.forward_signals:
            raise UsageError(f"{name} in both --signals-to-handle (stop the job) and --forward-signal (relay it, keep "
                             "running): choose one")
    version = torch_internals.parse_version(features.version)
    for dest in options.torchrun.passed_through:
        since = torchrun_compat.PASSED_THROUGH_SINCE.get(dest, (0, 0))
        if version < since:
            flag = "--" + dest.replace("_", "-")
            raise UsageError(f"{flag} needs torch >= {'.'.join(map(str, since))} under ddprun "
                             f"(torch {features.version} is installed); drop {flag}")


def _resolve_nproc(options: LaunchOptions, *, env: Mapping[str, str], inventory: Sequence[devices.Gpu],
                   cpu_count: int) -> LaunchOptions:
    """torchrun's auto|gpu|cpu as a count, then the sanity limit, before any per-rank list is built."""
    word, given = options.nproc, _given(options, "nproc", "--nproc", options.nproc)
    if isinstance(word, str):
        visible = [] if options.cpu else devices.visible_gpus(env.get("CUDA_VISIBLE_DEVICES"), inventory)
        if word == "gpu" and not visible:
            raise UsageError(f"{given}: no GPU is visible here; use --nproc-per-node cpu (or auto) for CPU processes")
        if word == "cpu" and options.gpus is not None:
            raise UsageError(f"{given} and --gpus exclude each other: cpu runs one CPU process per core")
        if word == "cpu" or (word == "auto" and not visible):
            options = replace(options, nproc=cpu_count, cpu=True)  # torchrun: one process per core
        else:
            return replace(options, nproc=None)  # one per selected GPU, checked by _choose_devices
    limit = MAX_CPU_PROCS_PER_CORE * cpu_count
    cpu_job = options.cpu or not devices.visible_gpus(env.get("CUDA_VISIBLE_DEVICES"), inventory)
    if cpu_job and isinstance(options.nproc, int) and options.nproc > limit and not options.force:
        raise UsageError(f"{given}: more than {limit} CPU processes ({MAX_CPU_PROCS_PER_CORE} per core, {cpu_count} "
                         f"cores) is usually a typo; e.g. --nproc {cpu_count}, or add --force")
    return options


def _cluster_flags(options: LaunchOptions) -> cluster.ClusterFlags:
    """torchrun's node options as ddprun's: on many nodes, static rendezvous is --master."""
    flags, t = options.cluster, options.torchrun
    nodes = cluster.parse_nnodes(flags.nnodes, flag=flags.label("nnodes", "--nnodes"))[1] if flags.nnodes else 1
    if t.standalone and (nodes > 1 or flags.rdzv_endpoint or flags.rdzv_id or t.master_port or t.master_addr):
        raise UsageError("--standalone is a one-node job with its own store: torchrun would ignore the "
                         "--nnodes/--rdzv-*/--master-* given with it; drop them, or drop --standalone")
    if nodes <= 1:
        return flags
    if t.rdzv_backend == "static" and flags.rdzv_endpoint and not flags.master:
        return replace(flags, master=flags.rdzv_endpoint, rdzv_endpoint=None)
    if t.master_addr is None and t.master_port is None:
        return flags
    if t.rdzv_backend == "c10d" or flags.rdzv_endpoint or flags.master:
        raise UsageError("--master-addr/--master-port name node 0 of static rendezvous; with c10d "
                         "(--rdzv-endpoint) torchrun ignores them: drop them")
    host = cluster.host_for(t.master_addr or LOOPBACK)
    return replace(flags, master=f"{host}:{t.master_port or cluster.DEFAULT_PORT}")


def _loopback_endpoint(spec: cluster.ClusterSpec) -> cluster.Sourced[cluster.Endpoint] | None:
    """A one-node c10d job whose endpoint is loopback: ddprun's own held store, like no endpoint."""
    found = spec.endpoint
    if spec.is_multi_node() or found is None or spec.rdzv_backend != "c10d":
        return None
    return found if torchrun_compat.is_loopback(found.value.host) else None


def _workers_master(options: LaunchOptions, spec: cluster.ClusterSpec) -> str | None:
    """torchrun's --master-port on one node: the workers' MASTER_ADDR:MASTER_PORT (rank 0 serves it)."""
    t = options.torchrun
    if spec.is_multi_node():
        if (t.master_port or t.master_addr) and options.cluster.nnodes is None:
            raise UsageError("--master-addr/--master-port on many nodes: give --nnodes N too (ddprun then uses "
                             "static rendezvous on node 0, as torchrun does)")
        return None
    if t.master_port is None:
        if t.master_addr is not None:
            raise UsageError(f"--master-addr {t.master_addr} without --master-port: on one node torchrun ignores it; "
                             "add --master-port PORT (the workers' MASTER_PORT), or drop it")
        return None
    return f"{cluster.host_for(t.master_addr or LOOPBACK)}:{t.master_port}"


def _rdzv_conf(options: LaunchOptions, spec: cluster.ClusterSpec) -> tuple[dict[str, int], float | None]:
    """--rdzv-conf's keys for this backend; its join timeout and --join-timeout are one value."""
    conf = dict(options.torchrun.rdzv_conf)
    known = torchrun_compat.RDZV_CONF_KEYS[spec.rdzv_backend]
    for key in conf:
        if key not in known:
            raise UsageError(f"--rdzv-conf {key}=...: not a key of {spec.rdzv_backend} rendezvous; known: {', '.join(known)}")
    key = "timeout" if spec.rdzv_backend == "static" else "join_timeout"  # each backend's own name
    join = conf.pop(key, None)
    if join is not None and options.join_timeout_s is not None and join != round(options.join_timeout_s):
        raise UsageError(f"--rdzv-conf {key}={join} and --join-timeout {options.join_timeout_s:g} disagree; give one")
    return conf, options.join_timeout_s if options.join_timeout_s is not None else join


def _choose_devices(options: LaunchOptions, *, env: Mapping[str, str], inventory: Sequence[devices.Gpu]) -> _Devices:
    if options.cpu:
        return _Devices("gloo", options.nproc or DEFAULT_CPU_PROCS, None, [])
    variable = env.get("CUDA_VISIBLE_DEVICES")
    visible = devices.visible_gpus(variable, inventory)
    if not visible and options.gpus is None:
        nproc = options.nproc or DEFAULT_CPU_PROCS
        why = "No GPU found" if not inventory else f"No GPU visible (CUDA_VISIBLE_DEVICES={variable!r})"
        return _Devices("gloo", nproc, None, [f"{why}: running {_count(nproc, 'CPU process')} on gloo."])
    request = options.gpus
    if request is None and options.nproc is not None:
        request = str(options.nproc)  # --nproc alone takes the first N visible GPUs
    selected = devices.select_gpus(request, visible, cuda_visible_devices=variable)
    nproc = options.nproc or len(selected)
    if nproc != len(selected):
        raise UsageError(
            f"--nproc {nproc} with {len(selected)} selected GPU(s): NCCL needs exactly one GPU per process; "
            f"use --nproc {len(selected)}, or --gpus {nproc}, or --cpu for CPU processes"
        )
    return _Devices("nccl", nproc, selected, [])


def _world_size(spec: cluster.ClusterSpec, nproc: int) -> int | None:
    return None if spec.is_elastic() else spec.max_nodes.value * nproc


def _check_ranks(ranks: tuple[int, ...] | None, world: int | None) -> list[int] | None:
    if ranks is None:
        return None
    limit = world if world is not None else None
    for rank in ranks:
        if rank < 0 or (limit is not None and rank >= limit):
            raise UsageError(
                f"--ranks {','.join(map(str, ranks))}: rank {rank} is outside the world of {limit} ranks (0-{limit - 1 if limit else 0}); "
                f"e.g. --ranks 0"
            )
    return sorted(set(ranks))


def _endpoint(spec: cluster.ClusterSpec, port: int | None) -> str:
    if spec.endpoint is None:
        return f"{LOOPBACK}:{port or 0}"  # port 0: ddprun binds a free port itself at launch
    return str(spec.endpoint.value)


def _store_role(spec: cluster.ClusterSpec) -> str:
    if spec.endpoint is None:
        return "host"
    if spec.rdzv_backend == "static":  # node 0 hosts it, as in torchrun's static rendezvous
        return "host" if spec.node_rank.value == 0 else "client"
    return "auto"


# Set for every rank at launch, beside torchrun's own (RANK, LOCAL_RANK, WORLD_SIZE, ...).
_LAUNCH_ENV = {
    envnames.LAUNCHER_PID_ENV: "the launcher's pid (a rank that finds another parent exits)",
    envnames.PID_FILE_ENV: "where the rank writes its pid (the launcher maps a dead pid to its rank)",
    envnames.ERROR_FILE_ENV: "where the rank records an uncaught exception",
    envnames.PROGRESS_FILE_ENV: "where the bundled trainer's rank 0 appends progress records",
    envnames.STACKS_FILE_ENV: "where the rank's faulthandler writes its stacks when asked (ddprun stacks, Ctrl-\\)",
}
_FRESH_STORE_ENV = {
    "MASTER_ADDR": "127.0.0.1: the workers' store, served by ddprun",
    "MASTER_PORT": "a fresh store per start of the workers",
    "TORCHELASTIC_USE_AGENT_STORE": "True: every rank connects to that store, none hosts one",
}
# torchrun's own handling of these stops the job; ddprun relays them when asked (--forward-signal).
_TORCH_STOP_SIGNALS = ("SIGHUP", "SIGQUIT")
# Ctrl-\ prints every rank's stacks without stopping the job, where torch lets ddprun have it.
_STACKS_SIGNALS = ("SIGQUIT",)


_MASTER_PORT_ENV = {
    "MASTER_ADDR": "--master-addr (127.0.0.1 by default): the workers' store, served by rank 0",
    "MASTER_PORT": "--master-port: rank 0 of the workers listens there, on every interface",
    "TORCHELASTIC_USE_AGENT_STORE": "False: rank 0 hosts the workers' store, as with a plain script",
}


def _launch_choices(spec: cluster.ClusterSpec, *, features: torch_internals.TorchFeatures,
                    forward: tuple[str, ...], grace_period_s: float, workers_master: str | None = None,
                    extra_signals: tuple[str, ...] = ()) -> LaunchChoices:
    role = _store_role(spec)
    single = spec.endpoint is None
    fresh = role == "host" and single and workers_master is None
    bind = LOOPBACK if single else (None if role == "client" else "endpoint")
    lost = ["the store on loopback only, bound and held by ddprun (torchrun binds every interface, "
            "and two jobs on one port join each other)"] if single else []
    lost += ["a fresh worker store for every restart"] if fresh else []
    lost += [f"the workers' MASTER_ADDR:MASTER_PORT {workers_master} (this line's store picks its own)"] \
        if workers_master else []
    return LaunchChoices(
        torch_version=features.version,
        store_bind=bind,
        store_implementation=features.store_implementation,
        agent_joins_held_store=bind is not None,
        fresh_worker_store=fresh,
        local_worker_store_hook=not single and role != "client" and spec.rdzv_backend != "static"
        and features.shared_store_switch,
        torch_signals=[s for s in _TORCH_STOP_SIGNALS if not features.launcher_handles_signals
                       or (s not in forward and s not in _STACKS_SIGNALS)] + list(extra_signals),
        grace_period_honoured=features.launcher_shutdown_timeout or grace_period_s == 30,
        launcher_env={torch_internals.DISABLE_SHARED_STORE_ENV: "1"} if fresh or workers_master else {},
        launch_env={**_LAUNCH_ENV, **(_FRESH_STORE_ENV if fresh else {}), **(_MASTER_PORT_ENV if workers_master else {})},
        lost_in_torchrun_line=lost,
        workers_master=workers_master,
        stacks_on_sigquit=features.launcher_handles_signals,
    )


def _warm_start(options: LaunchOptions, features: torch_internals.TorchFeatures) -> dict:
    """The bundled trainer starts warm unless --fresh-start (on the torch releases where that was
    verified); any other script starts fresh unless --warm-start, since a script may rely on what
    only a fresh interpreter gives (README, "Warm start"). torchrun's --no-python runs a program,
    not Python: nothing to keep warm."""
    entry = options.entrypoint
    trainer = entry.is_module and entry.target == TRAINER_MODULE
    default = trainer and features.warm_trainer_by_default
    warm = default if options.warm_start is None else bool(options.warm_start)
    if not warm or entry.no_python:
        return {"warm_start": False, "warm_preload": []}
    return {"warm_start": True, "warm_preload": list(WARM_PRELOAD_TRAINER if trainer else WARM_PRELOAD)}


def _sources(options: LaunchOptions, *, spec: cluster.ClusterSpec,
             local: cluster.Sourced[cluster.Endpoint] | None) -> dict[str, str]:
    """Where each value came from: the cluster's fields, then every option given by flag or variable."""
    out = spec.sources()
    if local is not None:
        out["endpoint"] = f"{local.source} (loopback on one node: ddprun's own held store)"
    if options.cluster.rdzv_id is not None and not spec.is_multi_node():
        out["user_rdzv_id"] = f"{options.labels.get('rdzv_id', '--rdzv-id')} (shown only: a one-node job's store key is secret)"
    # The rdzv id's own entry comes from the cluster (many nodes) only: the panel shows an id whose
    # source is not "default", and a one-node job's id is the secret.
    skip = {"rdzv_id", "dry_run", "as_json"}
    out.update({name: label for name, label in options.labels.items() if name not in out and name not in skip})
    out.update({name: label for name, label in options.torchrun.sources.items() if name not in out})
    return out


def _console(options: LaunchOptions, *, env: Mapping[str, str], terminal: bool, world: int | None) -> ConsoleChoices:
    t = options.torchrun
    template = t.log_line_prefix_template or torchrun_compat.check_prefix_template(
        torchrun_compat.Given(env.get(torchrun_compat.PREFIX_TEMPLATE_ENV) or None, torchrun_compat.PREFIX_TEMPLATE_ENV))
    tty_rank = options.tty_rank if options.tty_rank is not None else 0
    if world is not None and not 0 <= tty_rank < world:
        raise UsageError(f"--tty-rank {tty_rank}: the job has ranks 0-{world - 1}, e.g. --tty-rank 0")
    return ConsoleChoices(
        prefix_template=template or LINE_PREFIX_TEMPLATE,
        local_ranks=list(t.local_ranks_filter) if t.local_ranks_filter is not None else None,
        redirects=t.redirects,
        tee=t.tee,
        tty_rank=tty_rank if terminal else None,
    )


def _torchrun_notices(options: LaunchOptions, *, spec: cluster.ClusterSpec, workers_master: str | None,
                      join_timeout_s: float | None) -> list[str]:
    t, notes = options.torchrun, []
    if workers_master:
        notes.append(f"--master-port: rank 0 serves the workers' store on {workers_master}, on every interface, "
                     "and a restart reuses that port (without it: a fresh loopback store per start, held by ddprun).")
    if t.no_python and t.run_path:
        notes.append("--run-path takes precedence over --no-python, as in torchrun: the script runs with runpy.run_path.")
    last_call = t.rdzv_conf.get("last_call_timeout", torchrun_compat.LAST_CALL_DEFAULT_S)
    if spec.is_elastic() and join_timeout_s is not None and join_timeout_s <= last_call:
        notes.append(f"join timeout {join_timeout_s:g} s is not above last_call_timeout {last_call} s: once "
                     f"{spec.min_nodes.value} node(s) joined, the rendezvous waits {last_call} s for more, so it "
                     "times out first; lower it with --rdzv-conf last_call_timeout=N.")
    return notes


def _job_folder(root: str, job_id: str) -> str:
    return f"{root.rstrip('/')}/{job_id}"


def _flight_recorder_env(backend: str, *, env: Mapping[str, str], job_folder: str) -> dict[str, str]:
    """NCCL jobs: torch's flight recorder keeps each rank's last collectives and dumps them into
    the job folder when a collective times out; a variable the user set stays theirs."""
    if backend != "nccl":
        return {}
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{job_folder}/{FLIGHT_RECORDER_PREFIX}",
    }
    sized = "TORCH_FR_BUFFER_SIZE" in env  # torch's newer name for the buffer size
    return {k: v for k, v in wanted.items() if k not in env and not (sized and k == "TORCH_NCCL_TRACE_BUFFER_SIZE")}


def _worker_env(chosen: _Devices, *, env: Mapping[str, str], cpu_count: int, multi_node: bool) -> dict[str, str]:
    added: dict[str, str] = {}
    if chosen.selected is not None:
        added["CUDA_VISIBLE_DEVICES"] = devices.visible_devices_value(chosen.selected)
        if "CUDA_DEVICE_ORDER" not in env:
            added.update(devices.DEVICE_ORDER_ENV)
    if "OMP_NUM_THREADS" not in env:
        added["OMP_NUM_THREADS"] = str(max(1, cpu_count // chosen.nproc))
    if not multi_node:
        # Keep the workers' own sockets (gloo pairs, NCCL bootstrap) on loopback too.
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in env:
                added[name] = LOOPBACK_IFNAME
    return added


def _env_notices(added: Mapping[str, str], *, env: Mapping[str, str], cpu_count: int, nproc: int) -> list[str]:
    if "OMP_NUM_THREADS" in added:
        return [f"OMP_NUM_THREADS={added['OMP_NUM_THREADS']} ({cpu_count} cores / {_count(nproc, 'process')}); set it to override."]
    return []


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "es" if noun.endswith("s") else "s")


# ddprun's own flags that a user may type after the script by mistake.
_OWN_FLAGS = ("--dry-run", "--json", "--cpu", "--gpus", "--nproc", "--port", "--max-restarts", "--log-dir")


def _misplaced_flag_notices(entrypoint: Entrypoint) -> list[str]:
    found = [a for a in entrypoint.args if a.split("=", 1)[0] in _OWN_FLAGS]
    if not found:
        return []
    return [f"{found[0]} comes after the script, so the script gets it; ddprun's own options go before the script."]


def _device_labels(chosen: _Devices) -> list[str]:
    if chosen.selected is None:
        return [f"cpu (local rank {i})" for i in range(chosen.nproc)]
    return [devices.describe_gpu(g, ordinal=i) for i, g in enumerate(chosen.selected)]


def _torchrun_args(
    options: LaunchOptions, *, spec: cluster.ClusterSpec, nproc: int, rdzv_id: str, endpoint: str,
    conf: Mapping[str, int] | None = None, join_timeout_s: float | None = None,
) -> list[str]:
    args = ["--nnodes", spec.nnodes_text(), "--nproc-per-node", str(nproc)]
    if spec.rdzv_backend == "static":
        master = spec.endpoint.value
        args += ["--node-rank", str(spec.node_rank.value), "--master-addr", master.host, "--master-port", str(master.port)]
        args += ["--rdzv-backend", "static", "--rdzv-id", rdzv_id]
    else:
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]
    args += ["--local-addr", _local_addr(options, spec)] if spec.endpoint is None or options.torchrun.local_addr else []
    conf = dict(conf or {})
    if join_timeout_s is not None:
        key = "timeout" if spec.rdzv_backend == "static" else "join_timeout"  # each backend's own name
        conf[key] = max(1, round(join_timeout_s))
    if conf:
        args += ["--rdzv-conf", ",".join(f"{key}={value}" for key, value in conf.items())]
    args += ["--max-restarts", str(options.max_restarts)]
    for dest, value in options.torchrun.passed_through.items():  # checked by torchrun_compat
        args += [f"--{dest.replace('_', '-')}"] + ([value] if value else [])
    return args + ["-m", BOOTSTRAP_MODULE, *options.entrypoint.argv()]


def _local_addr(options: LaunchOptions, spec: cluster.ClusterSpec) -> str:
    given = options.torchrun.local_addr
    if spec.endpoint is None and given and not torchrun_compat.is_loopback(given):
        raise UsageError(f"--local-addr {given}: a one-node job stays on loopback (127.0.0.1); drop it")
    return LOOPBACK if spec.endpoint is None else given
