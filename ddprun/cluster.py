"""Where a job's nodes come from: explicit flags, SLURM, or Kubeflow / TorchElastic variables.

Everything here is a pure function of its arguments (flags and an env mapping), and every
value it decides remembers where it came from, so `--dry-run --json` can say why.
No torch import: the CLI reads this for --help and --dry-run.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Generic, Iterator, List, Mapping, NamedTuple, TypeVar, Union

from ddprun.errors import UsageError

DEFAULT_PORT = 29500

# One hostlist range longer than this is a typo, not a cluster; refuse it rather than expand it.
MAX_HOSTLIST_RANGE = 64 * 1024

# The rendezvous backends ddprun drives (torchrun also knows etcd, which needs a server of its own).
KNOWN_BACKENDS = ("c10d", "static")

T = TypeVar("T")

_DIGITS = re.compile(r"[0-9]+")
_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True)
class Sourced(Generic[T]):
    """A value and where it came from: a flag ("--nnodes"), a variable ("SLURM_NNODES"), "default"."""

    value: T
    source: str


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        # An IPv6 literal needs brackets, or the port would read as part of the address.
        return f"{host_for(self.host)}:{self.port}"


@dataclass(frozen=True)
class ClusterFlags:
    """What the user typed; None means not given."""

    nnodes: str | None = None
    node_rank: int | None = None
    master: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    # How a value was given when not by ddprun's own flag: {"nnodes": "PET_NNODES", ...}.
    labels: tuple[tuple[str, str], ...] = ()

    def label(self, name: str, flag: str) -> str:
        return dict(self.labels).get(name, flag)


@dataclass(frozen=True)
class ClusterSpec:
    min_nodes: Sourced[int]
    max_nodes: Sourced[int]
    node_rank: Sourced[int]  # 0 for a single-node job
    endpoint: Sourced[Endpoint] | None  # None: single-node job, ddprun hosts the store on loopback
    rdzv_id: Sourced[str] | None  # None: single-node job, the caller makes a unique one
    rdzv_backend: str  # "static" (fixed membership) or "c10d"
    scheduler: str | None  # "slurm", "kubeflow" or None
    gpus_on_node: Sourced[int] | None  # GPUs SLURM granted this node
    rdzv_backend_source: str = "default"

    def is_multi_node(self) -> bool:
        return self.max_nodes.value > 1

    def is_elastic(self) -> bool:
        return self.min_nodes.value != self.max_nodes.value

    def nnodes_text(self) -> str:
        """The value for torchrun's --nnodes: "2" or "1:4"."""
        if self.is_elastic():
            return f"{self.min_nodes.value}:{self.max_nodes.value}"
        return str(self.max_nodes.value)

    def sources(self) -> dict[str, str]:
        """Field -> where its value came from, for the `source` map of --dry-run --json."""
        found: dict[str, Sourced | None] = {
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
            "node_rank": self.node_rank,
            "endpoint": self.endpoint,
            "rdzv_id": self.rdzv_id,
            "gpus_on_node": self.gpus_on_node,
        }
        out = {name: item.source for name, item in found.items() if item is not None}
        out["rdzv_backend"] = self.rdzv_backend_source
        return out

    def as_json(self) -> dict[str, object]:
        """Plain JSON-ready values plus the `source` map."""

        def plain(item: Sourced | None) -> object:
            if item is None:
                return None
            return str(item.value) if isinstance(item.value, Endpoint) else item.value

        return {
            "nnodes": self.nnodes_text(),
            "min_nodes": plain(self.min_nodes),
            "max_nodes": plain(self.max_nodes),
            "node_rank": plain(self.node_rank),
            "endpoint": plain(self.endpoint),
            "rdzv_id": plain(self.rdzv_id),
            "rdzv_backend": self.rdzv_backend,
            "scheduler": self.scheduler,
            "gpus_on_node": plain(self.gpus_on_node),
            "source": self.sources(),
        }


# ---------------------------------------------------------------------------------------------
# Small parsers


def _shown(flag: str, text: str) -> str:
    """How the user wrote it: "--port 70000" for a flag, "MASTER_PORT=70000" for a variable."""
    return f"{flag} {text}" if flag.startswith("-") else f"{flag}={text}"


def parse_port(text: str, *, flag: str = "--port") -> int:
    """A TCP port, 1-65535 (0 would mean "any port", which other nodes cannot find)."""
    value = str(text).strip()
    if not _DIGITS.fullmatch(value) or not 1 <= int(value) <= 65535:
        example = _shown(flag, str(DEFAULT_PORT))
        raise UsageError(f"{_shown(flag, str(text))}: a port is 1-65535, e.g. {example}")
    return int(value)


def parse_nnodes(text: str, *, flag: str = "--nnodes") -> tuple[int, int]:
    """ "2" -> (2, 2); "1:4" -> (1, 4), an elastic job of 1 to 4 nodes."""
    value = str(text).strip()
    parts = value.split(":")
    example = f"e.g. {_shown(flag, '2')}, or {_shown(flag, '1:4')} for an elastic job of 1 to 4 nodes"
    if len(parts) > 2 or not all(_DIGITS.fullmatch(p) for p in parts):
        raise UsageError(f"{_shown(flag, value)}: expected a node count N or MIN:MAX, {example}")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise UsageError(f"{_shown(flag, value)}: a job needs at least 1 node, {example}")
    if low > high:
        raise UsageError(f"{_shown(flag, value)}: MIN is larger than MAX, e.g. {_shown(flag, f'{high}:{low}')}")
    return low, high


def _check_host(host: str, *, flag: str, text: str, example: str) -> None:
    if not host:
        raise UsageError(f"{_shown(flag, text)}: the host is missing, e.g. {example}")
    if _HOSTNAME.fullmatch(host):
        return
    try:
        ipaddress.ip_address(host)
    except ValueError:
        why = f"{host!r} is not a host name or IP address"
        raise UsageError(f"{_shown(flag, text)}: {why}, e.g. {example}") from None


def _split_endpoint(value: str, *, flag: str, example: str) -> tuple[str, str | None]:
    """ "host:port" -> ("host", "port"); "[v6]:port" -> ("v6", "port"); no port -> None."""
    shown = _shown(flag, value)
    if "://" in value:
        raise UsageError(f"{shown}: write HOST:PORT without a scheme, e.g. {example}")
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise UsageError(f"{shown}: expected [IPV6]:PORT, e.g. {example}")
        if ":" not in host:
            raise UsageError(f"{shown}: brackets are only for IPv6 addresses, e.g. {example}")
        return host, (rest[1:] if rest else None)
    if value.count(":") > 1:
        raise UsageError(f"{shown}: put an IPv6 address in brackets so the port is clear, e.g. {example}")
    host, sep, port = value.partition(":")
    return host, (port if sep else None)


def parse_endpoint(text: str, *, flag: str, default_port: int | None = None) -> Endpoint:
    """ "host:port", "1.2.3.4:29500", "[::1]:29500"; a bare host only when default_port is given."""
    value = str(text).strip()
    example = f"{_shown(flag, 'node0:29500')} or {_shown(flag, '[fd00::1]:29500')}"
    host, port = _split_endpoint(value, flag=flag, example=example)
    _check_host(host, flag=flag, text=value, example=example)
    fixed = _shown(flag, f"{host_for(host)}:{DEFAULT_PORT}")
    if port is None:
        if default_port is None:
            raise UsageError(f"{_shown(flag, value)}: add the port, e.g. {fixed}")
        return Endpoint(host, default_port)
    if not _DIGITS.fullmatch(port) or not 1 <= int(port) <= 65535:
        raise UsageError(f"{_shown(flag, value)}: the port must be a number from 1 to 65535, e.g. {fixed}")
    return Endpoint(host, int(port))


def host_for(host: str) -> str:
    """A host as written in front of ":PORT": an IPv6 address goes in brackets."""
    return f"[{host}]" if ":" in host else host


# ---------------------------------------------------------------------------------------------
# SLURM hostlists


def _hostlist_error(text: str, why: str) -> UsageError:
    return UsageError(f"hostlist {text!r}: {why}, e.g. 'gpu[01-04,07],cpu5'")


def _split_hostlist(text: str) -> list[str]:
    """Split at commas and blanks outside brackets; brackets must pair and not nest."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            if depth:
                raise _hostlist_error(text, "brackets cannot nest")
            depth = 1
        elif char == "]":
            if not depth:
                raise _hostlist_error(text, "']' without a matching '['")
            depth = 0
        elif char in ", \t\n" and not depth:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise _hostlist_error(text, "'[' without a matching ']'")
    items.append(text[start:])
    return [item for item in items if item]


class _Range(NamedTuple):
    low: int
    high: int
    width: int  # zero-padded to this many digits


# One part of a host pattern: literal text, or the numbers of one bracket.
_Piece = List[Union[str, _Range]]


def _parse_ranges(inner: str, *, text: str) -> _Piece:
    """ "01-03,7" -> [_Range(1, 3, 2), _Range(7, 7, 1)]."""
    if not inner:
        raise _hostlist_error(text, "empty brackets")
    ranges: _Piece = []
    for part in inner.split(","):
        low, sep, high = part.partition("-")
        high = high if sep else low
        if not (_DIGITS.fullmatch(low) and _DIGITS.fullmatch(high)):
            raise _hostlist_error(text, f"{part!r} is not a number or a range like 1-4")
        if int(low) > int(high):
            raise _hostlist_error(text, f"range {part!r} runs backwards")
        if int(high) - int(low) + 1 > MAX_HOSTLIST_RANGE:
            raise _hostlist_error(text, f"range {part!r} has more than {MAX_HOSTLIST_RANGE} hosts")
        # Like SLURM, the width of the low end sets the zero padding: 08-10 -> 08 09 10.
        ranges.append(_Range(int(low), int(high), len(low)))
    return ranges


def _parse_item(item: str, *, text: str) -> list[_Piece]:
    """One host pattern -> its pieces, e.g. "a[1-2]-ib" -> [["a"], [_Range(1, 2, 1)], ["-ib"]]."""
    pieces: list[_Piece] = []
    for part in re.split(r"(\[[^\]]*\])", item):
        if part.startswith("["):
            pieces.append(_parse_ranges(part[1:-1], text=text))
        elif part:
            pieces.append([part])
    return pieces


def _piece_values(piece: _Piece) -> Iterator[str]:
    for segment in piece:
        if isinstance(segment, str):
            yield segment
        else:
            for number in range(segment.low, segment.high + 1):
                yield str(number).zfill(segment.width)


def _expand(pieces: list[_Piece], prefix: str = "") -> Iterator[str]:
    # The first bracket varies slowest, as SLURM orders a[1-2]-ib[3-4].
    if not pieces:
        yield prefix
        return
    for value in _piece_values(pieces[0]):
        yield from _expand(pieces[1:], prefix + value)


def iter_hostlist(text: str) -> Iterator[str]:
    """Lazily expand a SLURM hostlist; the whole syntax is checked before the first host."""
    value = str(text).strip()
    parsed = [_parse_item(item, text=value) for item in _split_hostlist(value)]
    if not parsed:
        raise _hostlist_error(value, "no hosts")
    for pieces in parsed:
        yield from _expand(pieces)


def expand_hostlist(text: str) -> list[str]:
    """ "gpu[01-03,07],cpu5" -> ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]."""
    return list(iter_hostlist(text))


def first_host(text: str) -> str:
    """The first host of a hostlist, without expanding the rest."""
    return next(iter_hostlist(text))


# ---------------------------------------------------------------------------------------------
# Reading the environment


def _get(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of `names` set to a non-blank value, as (name, value)."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def _env_int(found: tuple[str, str], *, minimum: int, what: str, example: int) -> Sourced[int]:
    name, value = found
    if not _DIGITS.fullmatch(value) or int(value) < minimum:
        raise UsageError(
            f"{name}={value}: expected {what} (a whole number >= {minimum}), e.g. {name}={example}; "
            f"fix or unset {name}, or pass the value as a flag"
        )
    return Sourced(int(value), name)


def _gpu_count(env: Mapping[str, str]) -> Sourced[int] | None:
    count = _get(env, "SLURM_GPUS_ON_NODE")
    if count:
        return _env_int(count, minimum=0, what="a GPU count", example=8)
    indices = _get(env, "SLURM_STEP_GPUS")
    if indices is None:
        return None
    # A list of GPU indices like "0,1"; ranges like "0-3" are counted too.
    try:
        return Sourced(len(expand_hostlist(f"[{indices[1]}]")), indices[0])
    except UsageError:
        raise UsageError(f"{indices[0]}={indices[1]}: expected GPU indices, e.g. {indices[0]}=0,1") from None


@dataclass(frozen=True)
class _Detected:
    """What a scheduler's variables say; flags are merged on top of this."""

    scheduler: str | None = None
    min_nodes: Sourced[int] | None = None
    max_nodes: Sourced[int] | None = None
    node_rank: Sourced[int] | None = None
    endpoint: Sourced[Endpoint] | None = None
    rdzv_id: Sourced[str] | None = None
    backend: Sourced[str] | None = None
    gpus_on_node: Sourced[int] | None = None
    in_step: bool = True  # SLURM: under srun (one copy per node), not in the batch script
    tasks: Sourced[int] | None = None  # SLURM: tasks in this step


def _endpoint_from(
    env: Mapping[str, str], host: tuple[str, str], port_names: tuple[str, ...]
) -> Sourced[Endpoint]:
    """Host from one variable, port from another (or DEFAULT_PORT); the source names both."""
    port = _get(env, *port_names)
    if port is None:
        return Sourced(Endpoint(host[1], DEFAULT_PORT), host[0])
    return Sourced(Endpoint(host[1], parse_port(port[1], flag=port[0])), f"{host[0]}:{port[0]}")


def _slurm_endpoint(env: Mapping[str, str]) -> Sourced[Endpoint] | None:
    nodelist = _get(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if nodelist is None:
        return None
    name, value = nodelist
    try:
        host = first_host(value)
    except UsageError as err:
        raise UsageError(f"{name}: {err.message}") from None
    return _endpoint_from(env, (name, host), ("MASTER_PORT",))


def _slurm(env: Mapping[str, str]) -> _Detected | None:
    """Inside a SLURM job. The step's own variables come first: `srun -N2` in a 4-node
    allocation is a 2-node job, and SLURM_NODEID counts within the step."""
    count = _get(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if not _get(env, "SLURM_JOB_ID") or count is None:
        return None
    nodes = _env_int(count, minimum=1, what="a node count", example=2)
    rank = _get(env, "SLURM_NODEID")
    tasks = _get(env, "SLURM_STEP_NUM_TASKS")
    return _Detected(
        scheduler="slurm",
        min_nodes=nodes,
        max_nodes=nodes,
        node_rank=_env_int(rank, minimum=0, what="a node rank", example=0) if rank else None,
        endpoint=_slurm_endpoint(env),
        rdzv_id=Sourced(env["SLURM_JOB_ID"].strip(), "SLURM_JOB_ID"),
        backend=Sourced("c10d", "default"),
        gpus_on_node=_gpu_count(env),
        in_step=_get(env, "SLURM_STEP_ID", "SLURM_STEPID") is not None,
        tasks=_env_int(tasks, minimum=1, what="a task count", example=2) if tasks else None,
    )


def _kubeflow_endpoint(env: Mapping[str, str]) -> Sourced[Endpoint] | None:
    rdzv = _get(env, "PET_RDZV_ENDPOINT")
    if rdzv:
        return Sourced(parse_endpoint(rdzv[1], flag=rdzv[0], default_port=DEFAULT_PORT), rdzv[0])
    addr = _get(env, "PET_MASTER_ADDR", "MASTER_ADDR")
    if addr is None:
        return None
    _check_host(addr[1], flag=addr[0], text=addr[1], example=f"{addr[0]}=node0")
    return _endpoint_from(env, addr, ("PET_MASTER_PORT", "MASTER_PORT"))


def _kubeflow_backend(env: Mapping[str, str]) -> Sourced[str]:
    # Without PET_RDZV_BACKEND we use static rendezvous, as torchrun itself would: the operator
    # gave every pod a fixed rank and the master's address, so membership is already decided
    # and nothing needs negotiating. An elasticPolicy sets PET_RDZV_BACKEND (c10d by default).
    # Any other value is refused in _check_backend, after flags had their chance to override it.
    found = _get(env, "PET_RDZV_BACKEND")
    if found is None:
        return Sourced("static", "default")
    return Sourced(found[1], found[0])


def _kubeflow_nnodes(env: Mapping[str, str]) -> tuple[Sourced[int], Sourced[int]]:
    # Newer operators set WORLD_SIZE to pods x processes per pod, but then always set PET_NNODES.
    pet = _get(env, "PET_NNODES")
    if pet:
        low, high = parse_nnodes(pet[1], flag=pet[0])
        return Sourced(low, pet[0]), Sourced(high, pet[0])
    world = _get(env, "WORLD_SIZE") or ("WORLD_SIZE", "")
    nodes = _env_int(world, minimum=1, what="a node count", example=2)
    return nodes, nodes


def _kubeflow(env: Mapping[str, str]) -> _Detected | None:
    """A Kubeflow PyTorchJob / TrainJob pod. PET_* win over the plain names, as in torchrun."""
    # A torchrun worker sees MASTER_ADDR/WORLD_SIZE/RANK too, but counting processes, not nodes.
    if _get(env, "TORCHELASTIC_RUN_ID") and _get(env, "LOCAL_RANK"):
        return None
    plain = all(_get(env, name) for name in ("MASTER_ADDR", "WORLD_SIZE", "RANK"))
    pet = _get(env, "PET_NNODES") and _get(env, "PET_MASTER_ADDR", "PET_RDZV_ENDPOINT")
    if not (plain or pet):
        return None
    low, high = _kubeflow_nnodes(env)
    rank = _get(env, "PET_NODE_RANK", "RANK")
    rdzv_id = _get(env, "PET_RDZV_ID")
    return _Detected(
        scheduler="kubeflow",
        min_nodes=low,
        max_nodes=high,
        node_rank=_env_int(rank, minimum=0, what="a node rank", example=0) if rank else None,
        endpoint=_kubeflow_endpoint(env),
        rdzv_id=Sourced(rdzv_id[1], rdzv_id[0]) if rdzv_id else None,
        backend=_kubeflow_backend(env),
    )


def detect_scheduler(env: Mapping[str, str]) -> str | None:
    """ "slurm", "kubeflow" or None, from the environment alone."""
    return (_slurm(env) or _kubeflow(env) or _Detected()).scheduler


# ---------------------------------------------------------------------------------------------
# Flags


@dataclass(frozen=True)
class _Given:
    """The flags, parsed and checked one by one."""

    nnodes: tuple[Sourced[int], Sourced[int]] | None = None
    node_rank: Sourced[int] | None = None
    master: Sourced[Endpoint] | None = None
    rdzv_endpoint: Sourced[Endpoint] | None = None
    rdzv_id: Sourced[str] | None = None


_BOTH_ENDPOINTS = (
    "--master and --rdzv-endpoint both given: use --master HOST:PORT for a fixed set of nodes "
    "(e.g. --nnodes 2 --node-rank 0 --master node0:29500), or --rdzv-endpoint HOST:PORT for "
    "c10d / elastic (e.g. --nnodes 1:4 --rdzv-endpoint node0:29500)"
)


def _parse_flags(flags: ClusterFlags) -> _Given:
    nnodes = rank = master = rdzv = run_id = None
    if flags.nnodes is not None:
        label = flags.label("nnodes", "--nnodes")
        low, high = parse_nnodes(flags.nnodes, flag=label)
        nnodes = (Sourced(low, label), Sourced(high, label))
    if flags.node_rank is not None:
        label = flags.label("node_rank", "--node-rank")
        if flags.node_rank < 0:
            raise UsageError(f"{_shown(label, str(flags.node_rank))}: node ranks start at 0, e.g. --node-rank 0")
        rank = Sourced(int(flags.node_rank), label)
    if flags.master is not None:
        label = flags.label("master", "--master")
        master = Sourced(parse_endpoint(flags.master, flag=label), label)
    if flags.rdzv_endpoint is not None:
        label = flags.label("rdzv_endpoint", "--rdzv-endpoint")
        rdzv = Sourced(parse_endpoint(flags.rdzv_endpoint, flag=label), label)
    if flags.rdzv_id is not None:
        label = flags.label("rdzv_id", "--rdzv-id")
        if not flags.rdzv_id.strip() or any(c.isspace() for c in flags.rdzv_id):
            raise UsageError(f"{_shown(label, repr(flags.rdzv_id))}: give a name without blanks, e.g. --rdzv-id exp42")
        run_id = Sourced(flags.rdzv_id, label)
    if master and rdzv:
        raise UsageError(_BOTH_ENDPOINTS)
    return _Given(nnodes, rank, master, rdzv, run_id)


# ---------------------------------------------------------------------------------------------
# Merging and checking


def _backend(given: _Given, found: _Detected) -> Sourced[str]:
    if given.master:
        return Sourced("static", "--master")
    if given.rdzv_endpoint:
        return Sourced("c10d", "--rdzv-endpoint")
    return found.backend or Sourced("c10d", "default")


def _default_rdzv_id(endpoint: Sourced[Endpoint] | None) -> Sourced[str] | None:
    # Every node computes the same id from the same endpoint, so they agree without a flag.
    if endpoint is None:
        return None
    return Sourced(f"ddprun-{endpoint.value.host}-{endpoint.value.port}", "default")


def _merge(given: _Given, found: _Detected) -> ClusterSpec:
    default = Sourced(1, "default")
    low, high = given.nnodes or (found.min_nodes or default, found.max_nodes or default)
    multi = high.value > 1
    endpoint = given.master or given.rdzv_endpoint or (found.endpoint if multi else None)
    rdzv_id = given.rdzv_id or ((found.rdzv_id or _default_rdzv_id(endpoint)) if multi else None)
    backend = _backend(given, found)
    return ClusterSpec(
        min_nodes=low,
        max_nodes=high,
        node_rank=given.node_rank or found.node_rank or Sourced(0, "default"),
        endpoint=endpoint,
        rdzv_id=rdzv_id,
        rdzv_backend=backend.value,
        scheduler=found.scheduler,
        gpus_on_node=found.gpus_on_node,
        rdzv_backend_source=backend.source,
    )


def _from(item: Sourced) -> str:
    return "by default" if item.source == "default" else f"from {item.source}"


def _nodes(spec: ClusterSpec) -> str:
    return f"{spec.nnodes_text()} nodes ({_from(spec.max_nodes)})"


def _static_why(spec: ClusterSpec) -> str:
    if spec.rdzv_backend_source == "--master":
        return "--master"
    source = "by default" if spec.rdzv_backend_source == "default" else f"from {spec.rdzv_backend_source}"
    return f"static rendezvous ({source})"


def _check_backend(spec: ClusterSpec) -> None:
    if spec.rdzv_backend not in KNOWN_BACKENDS:
        raise UsageError(
            f"{spec.rdzv_backend_source}={spec.rdzv_backend}: ddprun uses c10d or static rendezvous; "
            f"set {spec.rdzv_backend_source}=c10d, or pass the address, e.g. --rdzv-endpoint node0:29500"
        )


def _check_elastic(spec: ClusterSpec) -> None:
    if not spec.is_elastic():
        return
    example = f"e.g. --nnodes {spec.nnodes_text()} --rdzv-endpoint node0:29500"
    if spec.rdzv_backend == "static":
        instead = " instead of --master" if spec.rdzv_backend_source == "--master" else ""
        raise UsageError(
            f"an elastic job of {_nodes(spec)} needs c10d rendezvous, but {_static_why(spec)} "
            f"fixes the set of nodes: give a c10d address{instead}, {example}"
        )
    if spec.endpoint is None:
        raise UsageError(
            f"an elastic job of {_nodes(spec)} needs a rendezvous address every node can reach: "
            f"add --rdzv-endpoint HOST:PORT, {example}"
        )


def _check_static(spec: ClusterSpec, given: _Given) -> None:
    if spec.rdzv_backend != "static":
        return
    if given.master and spec.max_nodes.source == "default":
        raise UsageError(
            "--master fixes the set of nodes, so it needs their number: add --nnodes N and --node-rank R, "
            "e.g. --nnodes 2 --node-rank 0 --master node0:29500 (--node-rank 1 on the second node)"
        )
    if spec.is_multi_node() and spec.node_rank.source == "default":
        raise UsageError(
            f"{_nodes(spec)} with {_static_why(spec)} need this node's rank: add --node-rank R "
            f"(0 on the master's node), e.g. --nnodes {spec.nnodes_text()} --node-rank 0 --master node0:29500"
        )


def _check_slurm_step(spec: ClusterSpec, found: _Detected) -> None:
    """ddprun must run once per node: catch the batch script, and srun with many tasks per node."""
    if found.scheduler != "slurm" or not spec.is_multi_node() or spec.max_nodes.source == "--nnodes":
        return
    if not found.in_step:
        raise UsageError(
            f"{spec.max_nodes.source}={spec.max_nodes.value} but this is not a job step (no SLURM_STEP_ID), "
            "so ddprun would start on this node only and wait for the others: start one per node, "
            "e.g. srun --ntasks-per-node=1 ddprun ..., or pass --nnodes 1 for a single-node run"
        )
    if found.tasks is not None and found.tasks.value > spec.max_nodes.value:
        raise UsageError(
            f"{found.tasks.source}={found.tasks.value} on {spec.max_nodes.value} nodes: srun started more than "
            "one ddprun per node, but ddprun starts the per-GPU workers itself; "
            "use one task per node, e.g. srun --ntasks-per-node=1 ddprun ..."
        )


def _check_nodes(spec: ClusterSpec, given: _Given) -> None:
    if spec.is_multi_node() and spec.endpoint is None:
        raise UsageError(
            f"{_nodes(spec)} need an address every node can reach: add --master HOST:PORT, the same on "
            f"every node, e.g. --nnodes {spec.nnodes_text()} --node-rank 0 --master node0:29500"
        )
    if given.node_rank and given.node_rank.value != 0 and spec.rdzv_backend == "c10d" and spec.is_multi_node():
        raise UsageError(
            f"{_shown(given.node_rank.source, str(given.node_rank.value))} with c10d rendezvous "
            f"({spec.nnodes_text()} nodes): c10d gives each node its rank, so torchrun would ignore it; drop it, "
            "or use static rendezvous, e.g. --nnodes 2 --node-rank 1 --master node0:29500"
        )
    if given.node_rank and spec.max_nodes.source == "default":
        raise UsageError(
            f"--node-rank {given.node_rank.value} only applies to a multi-node job: drop it, or add the "
            f"nodes, e.g. --nnodes 2 --node-rank {given.node_rank.value} --master node0:29500"
        )
    rank, high = spec.node_rank.value, spec.max_nodes.value
    if rank >= high:
        raise UsageError(
            f"node rank {rank} ({_from(spec.node_rank)}) is out of range for {high} node(s) "
            f"({_from(spec.max_nodes)}): ranks run 0 to {high - 1}, e.g. --node-rank {high - 1}"
        )


def detect_cluster(flags: ClusterFlags, env: Mapping[str, str]) -> ClusterSpec:
    """Decide the job's nodes: flags always win, then SLURM, then Kubeflow / TorchElastic
    variables, then a single node. Everything is checked here, before anything starts."""
    given = _parse_flags(flags)
    found = _slurm(env) or _kubeflow(env) or _Detected()
    spec = _merge(given, found)
    _check_backend(spec)
    _check_elastic(spec)
    _check_static(spec, given)
    _check_slurm_step(spec, found)
    _check_nodes(spec, given)
    return spec


__all__ = [
    "DEFAULT_PORT",
    "KNOWN_BACKENDS",
    "MAX_HOSTLIST_RANGE",
    "ClusterFlags",
    "ClusterSpec",
    "Endpoint",
    "Sourced",
    "detect_cluster",
    "detect_scheduler",
    "expand_hostlist",
    "first_host",
    "host_for",
    "iter_hostlist",
    "parse_endpoint",
    "parse_nnodes",
    "parse_port",
]
