"""From what the user asked for to the exact torchrun invocation: a pure function and its value.

`build_plan` reads nothing from the process: the environment, the GPU inventory and the
core count are arguments, so every rule here is tested directly.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

from ddprun import cluster, devices, envnames, runfolders, torch_internals
from ddprun.errors import UsageError

LOOPBACK = "127.0.0.1"
LOOPBACK_IFNAME = "lo"
BOOTSTRAP_MODULE = "ddprun.worker.bootstrap"
DEFAULT_CPU_PROCS = 2
DEFAULT_GRACE_PERIOD_S = 10.0
DEFAULT_JOIN_TIMEOUT_S = 600.0  # torch's own default for both rendezvous backends
# The signals a scheduler sends before preemption; forwarded to workers only on request.
FORWARDABLE_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP")


@dataclass(frozen=True)
class Entrypoint:
    """The user's code: a script path or a module name, and its arguments, passed on untouched."""

    target: str
    args: tuple[str, ...] = ()
    is_module: bool = False

    def argv(self) -> list[str]:
        return (["-m", self.target] if self.is_module else [self.target]) + list(self.args)

    def describe(self) -> str:
        return shlex.join((["-m"] if self.is_module else []) + [self.target, *self.args])


@dataclass(frozen=True)
class LaunchOptions:
    """Everything the user typed that shapes the launch. None means 'not given'."""

    entrypoint: Entrypoint
    gpus: str | None = None
    cpu: bool = False
    nproc: int | None = None
    port: int | None = None
    cluster: cluster.ClusterFlags = field(default_factory=cluster.ClusterFlags)
    max_restarts: int = 0
    log_dir: str | None = None
    keep_logs: int = runfolders.DEFAULT_KEEP
    ranks: tuple[int, ...] | None = None
    grace_period_s: float = DEFAULT_GRACE_PERIOD_S
    join_timeout_s: float | None = None
    forward_signals: tuple[str, ...] = ()


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
) -> LaunchPlan:
    """Decide everything about the launch; raise UsageError for anything wrong with the request.

    `rdzv_secret` names the rendezvous when the user gave no id: torch's c10d rendezvous keeps
    its state as a pickle under that name in a store every local user can reach, so the name
    must be unguessable and shown nowhere (the job id, which names the log folder, is not it).
    """
    _check_generic_options(options)
    features = torch_internals.features_for(torch_version)
    _check_torch_features(options, features)
    chosen = _choose_devices(options, env=env, inventory=inventory)
    spec = cluster.detect_cluster(options.cluster, env)
    world = _world_size(spec, chosen.nproc)
    ranks = _check_ranks(options.ranks, world)
    rdzv_id = str(spec.rdzv_id.value) if spec.rdzv_id else rdzv_secret
    endpoint = _endpoint(spec, options.port)
    worker_env = _worker_env(chosen, env=env, cpu_count=cpu_count, multi_node=spec.is_multi_node())
    notices = chosen.notices + _env_notices(worker_env, env=env, cpu_count=cpu_count, nproc=chosen.nproc)
    notices += _misplaced_flag_notices(options.entrypoint)
    return LaunchPlan(
        torchrun_args=_torchrun_args(options, spec=spec, nproc=chosen.nproc, rdzv_id=rdzv_id, endpoint=endpoint),
        env=worker_env,
        nproc_per_node=chosen.nproc,
        nnodes=spec.nnodes_text(),
        world_size=world,
        backend=chosen.backend,
        devices=[g.entry for g in chosen.selected] if chosen.selected is not None else None,
        device_labels=_device_labels(chosen),
        entrypoint=options.entrypoint.describe(),
        job_id=job_id,
        rdzv_id=rdzv_id,
        endpoint=endpoint,
        store_role=_store_role(spec),
        log_dir=f"{(options.log_dir or log_root).rstrip('/')}/{job_id}",  # never the user's folder itself
        private_log_root=options.log_dir is None,
        keep_logs=options.keep_logs,
        ranks=ranks,
        grace_period_s=options.grace_period_s,
        join_timeout_s=options.join_timeout_s or DEFAULT_JOIN_TIMEOUT_S,
        forward_signals=list(options.forward_signals),
        notices=notices,
        source=spec.sources(),
        launch=_launch_choices(spec, features=features, forward=options.forward_signals,
                               grace_period_s=options.grace_period_s),
    )


def _check_generic_options(options: LaunchOptions) -> None:
    if options.nproc is not None and options.nproc < 1:
        raise UsageError(f"--nproc {options.nproc}: the number of processes per node must be at least 1, e.g. --nproc 2")
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


def _check_torch_features(options: LaunchOptions, features: torch_internals.TorchFeatures) -> None:
    if "SIGHUP" in options.forward_signals and not features.launcher_handles_signals:
        raise UsageError(f"--forward-signal SIGHUP needs torch >= 2.10: torch {features.version} stops the job "
                         "on SIGHUP itself; forward SIGUSR1 or SIGUSR2 instead")


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
}
_FRESH_STORE_ENV = {
    "MASTER_ADDR": "127.0.0.1: the workers' store, served by ddprun",
    "MASTER_PORT": "a fresh store per start of the workers",
    "TORCHELASTIC_USE_AGENT_STORE": "True: every rank connects to that store, none hosts one",
}
# torchrun's own handling of these stops the job; ddprun relays them when asked (--forward-signal).
_TORCH_STOP_SIGNALS = ("SIGHUP", "SIGQUIT")


def _launch_choices(spec: cluster.ClusterSpec, *, features: torch_internals.TorchFeatures,
                    forward: tuple[str, ...], grace_period_s: float) -> LaunchChoices:
    role = _store_role(spec)
    single = spec.endpoint is None
    fresh = role == "host" and single
    bind = LOOPBACK if single else (None if role == "client" else "endpoint")
    lost = ["the store on loopback only, bound and held by ddprun (torchrun binds every interface, "
            "and two jobs on one port join each other)"] if single else []
    lost += ["a fresh worker store for every restart"] if fresh else []
    return LaunchChoices(
        torch_version=features.version,
        store_bind=bind,
        store_implementation=features.store_implementation,
        agent_joins_held_store=bind is not None,
        fresh_worker_store=fresh,
        local_worker_store_hook=not single and role != "client" and spec.rdzv_backend != "static"
        and features.shared_store_switch,
        torch_signals=[s for s in _TORCH_STOP_SIGNALS if s not in forward or not features.launcher_handles_signals],
        grace_period_honoured=features.launcher_shutdown_timeout or grace_period_s == 30,
        launcher_env={torch_internals.DISABLE_SHARED_STORE_ENV: "1"} if fresh else {},
        launch_env={**_LAUNCH_ENV, **(_FRESH_STORE_ENV if fresh else {})},
        lost_in_torchrun_line=lost,
    )


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
    options: LaunchOptions, *, spec: cluster.ClusterSpec, nproc: int, rdzv_id: str, endpoint: str
) -> list[str]:
    args = ["--nnodes", spec.nnodes_text(), "--nproc-per-node", str(nproc)]
    if spec.rdzv_backend == "static":
        master = spec.endpoint.value
        args += ["--node-rank", str(spec.node_rank.value), "--master-addr", master.host, "--master-port", str(master.port)]
        args += ["--rdzv-backend", "static", "--rdzv-id", rdzv_id]
    else:
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]
    if spec.endpoint is None:
        args += ["--local-addr", LOOPBACK]
    if options.join_timeout_s is not None:
        key = "timeout" if spec.rdzv_backend == "static" else "join_timeout"  # each backend's own name
        args += ["--rdzv-conf", f"{key}={max(1, round(options.join_timeout_s))}"]
    args += ["--max-restarts", str(options.max_restarts)]
    return args + ["-m", BOOTSTRAP_MODULE, *options.entrypoint.argv()]
