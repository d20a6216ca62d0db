"""torchrun's command line on `ddprun run`: its options, its PET_* variables, and what they become.

Switching is one edit (torchrun -> ddprun run), so every torchrun option is accepted in both
spellings with torchrun's meaning. `OPTIONS` is the table (README's "From torchrun" table is
its copy); the parsers here turn torchrun's values into typed `TorchrunChoices` that the plan
reads. Precedence is the flag, then ddprun's own DDPRUN_* variable, then torchrun's PET_*
variable, then the default; each value remembers which one it came from.
Pure functions, but for one context manager used at launch; no torch import (this runs on
--help and --dry-run).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import string
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from ddprun.errors import UsageError

_DIGITS = re.compile(r"[0-9]+")
_SECONDS = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")
_WORD = re.compile(r"[A-Za-z0-9_.:-]+")


@dataclass(frozen=True)
class TorchrunOption:
    """One option of torchrun's parser (torch/distributed/run.py) and what ddprun makes of it."""

    names: tuple[str, ...]  # torchrun's spellings; the first is the one ddprun shows
    dest: str  # torchrun's argparse dest: PET_<DEST> is its variable
    ddprun: str  # ddprun's equivalent, as the README table says it
    reads_env: bool = True  # torchrun reads PET_<DEST> (action=env / check_env)
    is_switch: bool = False  # takes no value
    param: str | None = None  # the parameter of `ddprun run` that takes it

    @property
    def variable(self) -> str | None:
        return f"PET_{self.dest.upper()}" if self.reads_env else None


def _opt(dashed: str, ddprun: str, *, param: str | None = None, switch: bool = False,
         env: bool = True, short: str | None = None) -> TorchrunOption:
    dest = dashed.lstrip("-").replace("-", "_")
    names = (dashed,) + ((f"--{dest}",) if "_" in dest else ()) + ((short,) if short else ())
    return TorchrunOption(names, dest, ddprun, reads_env=env, is_switch=switch, param=param or dest)


OPTIONS: tuple[TorchrunOption, ...] = (
    _opt("--nnodes", "`--nnodes` (same)"),
    _opt("--nproc-per-node", "`--nproc` (alias); `auto`, `gpu`, `cpu` or N, checked against the GPUs", param="nproc"),
    _opt("--rdzv-backend", "same; `c10d` or `static` (etcd is refused)"),
    _opt("--rdzv-endpoint", "same; on one node with a loopback address: ddprun's held store, on that port when free"),
    _opt("--rdzv-id", "same on many nodes; on one node shown only (the store key stays a secret)"),
    _opt("--rdzv-conf", "same keys, checked; `join_timeout` is `--join-timeout`; `is_host` is ddprun's"),
    _opt("--standalone", "the default of a one-node job (ddprun's own loopback store)", switch=True),
    _opt("--max-restarts", "`--max-restarts` (same)"),
    _opt("--monitor-interval", "same, passed to torch"),
    _opt("--start-method", "same, passed to torch (ddprun starts a command, so it changes nothing)"),
    _opt("--event-log-handler", "same, passed to torch (torch >= 2.14)"),
    _opt("--role", "same, passed to torch"),
    _opt("--module", "`-m` / `--module` (same)", switch=True, short="-m"),
    _opt("--no-python", "same: the entrypoint is executed as a program, after ddprun's worker setup", switch=True),
    _opt("--run-path", "same: ddprun always runs a script with runpy.run_path", switch=True),
    _opt("--log-dir", "`--log-dir` (alias): per-job folder DIR/<job id>/"),
    _opt("--redirects", "same per local rank; a redirected stream leaves the console (files keep everything)", short="-r"),
    _opt("--tee", "same per local rank: the stream is shown and kept (ddprun always keeps files)", short="-t"),
    _opt("--log-line-prefix-template", "same (also TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE); default `[rank ${rank}] `"),
    _opt("--local-ranks-filter", "same (local ranks); `--ranks` filters global ranks"),
    _opt("--duplicate-stdout-filters", "same, passed to torch (torch >= 2.14)"),
    _opt("--duplicate-stderr-filters", "same, passed to torch (torch >= 2.14)"),
    _opt("--node-rank", "`--node-rank` (same); refused where torchrun would ignore it (c10d)"),
    _opt("--master-addr", "same: with `--master-port`, the workers' MASTER_ADDR on one node; node 0 on many (`--master`)"),
    _opt("--master-port", "same: the workers' MASTER_PORT on one node (rank 0 serves it); node 0's port on many"),
    _opt("--local-addr", "same on many nodes; one node stays on 127.0.0.1"),
    _opt("--logs-specs", "refused: ddprun writes every rank's logs itself", env=False),
    _opt("--numa-binding", "same, passed to torch (torch >= 2.14)", env=False),
    _opt("--signals-to-handle", "SIGTERM, SIGINT are always handled; SIGUSR1, SIGUSR2, SIGHUP become `--forward-signal`"),
    _opt("--shutdown-timeout", "`--grace-period` (alias)", param="grace_period"),
    _opt("--virtual-local-rank", "same, passed to torch (torch >= 2.14)", switch=True),
    _opt("--print-completion", "refused: ddprun prints no completion script", env=False),
)
BY_DEST = {o.dest: o for o in OPTIONS}
ALL_SPELLINGS = tuple(name for o in OPTIONS for name in o.names)

# torchrun options ddprun hands to torch's own parser unchanged (after checking them), and the
# oldest torch whose parser was verified to have them.
PASSED_THROUGH_SINCE = {
    "monitor_interval": (2, 4), "start_method": (2, 4), "role": (2, 4),
    "event_log_handler": (2, 14), "numa_binding": (2, 14), "virtual_local_rank": (2, 14),
    "duplicate_stdout_filters": (2, 14), "duplicate_stderr_filters": (2, 14),
}
START_METHODS = ("spawn", "fork", "forkserver")
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")
PREFIX_MACROS = ("role_name", "local_rank", "rank", "hostname")
# c10d's --rdzv-conf keys (dynamic_rendezvous / c10d_rendezvous_backend), all whole numbers of
# seconds or counts; static rendezvous reads "timeout". ddprun sets "is_host" and "rank" itself.
RDZV_CONF_KEYS = {
    "c10d": ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
             "read_timeout", "keep_alive_interval", "keep_alive_max_attempt"),
    "static": ("timeout", "read_timeout"),
}
RDZV_CONF_RESERVED = ("is_host", "rank")
LAST_CALL_DEFAULT_S = 30  # torch's c10d default: how long it waits for more nodes once MIN joined
PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


# --- where a value came from ----------------------------------------------------------------


@dataclass(frozen=True)
class Given:
    """A raw option value and where it came from: "--nproc", "DDPRUN_NPROC", "PET_NPROC_PER_NODE"."""

    text: str | None
    label: str | None  # None: the default

    def shown(self) -> str:
        return shown(self.label or "", self.text or "")


def shown(label: str, text: str) -> str:
    """As the user wrote it: "--nproc 3" for a flag, "PET_NPROC_PER_NODE=3" for a variable."""
    return f"{label} {text}" if label.startswith("-") else f"{label}={text}"


def given_values(values: Mapping[str, object], *, sources: Mapping[str, str], flags: Mapping[str, str],
                 envvars: Mapping[str, str], env: Mapping[str, str]) -> dict[str, Given]:
    """Each parameter's raw value and its source: the flag, ddprun's variable, torchrun's PET_*
    variable (only where neither was given), or the default.

    `sources` maps a parameter to "flag", "env" or "default" (click's ParameterSource), `flags` to
    the option's name to show, `envvars` to its DDPRUN_* variable.
    """
    pet_for = {o.param: o.variable for o in OPTIONS if o.variable}
    out: dict[str, Given] = {}
    for name, value in values.items():
        source = sources.get(name, "default")
        if source == "flag":
            out[name] = Given(_text(value), flags.get(name, f"--{name.replace('_', '-')}"))
        elif source == "env":
            out[name] = Given(_text(value), envvars.get(name))
        elif pet_for.get(name) and env.get(pet_for[name], "").strip():
            out[name] = Given(env[pet_for[name]].strip(), pet_for[name])
        else:
            out[name] = Given(_text(value), None)
    return out


def _text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "1" if value else None
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) if value else None
    return str(value)


def switch(item: Given) -> bool:
    """A switch given as a flag, or a PET_ variable read as torchrun reads it (0 or 1 only)."""
    if item.text is None:
        return False
    if item.label and not item.label.startswith("-"):
        if item.text not in ("0", "1"):
            raise UsageError(f"{item.shown()}: expected 0 or 1, e.g. {item.label}=1; fix or unset {item.label}")
        return item.text == "1"
    return True


# --- small parsers --------------------------------------------------------------------------


def parse_whole(text: str, *, label: str, example: str, minimum: int | None = None) -> int:
    """A whole number in ASCII digits (an optional leading '-'): no '1_0', no full-width digits."""
    value = text.strip()
    body = value[1:] if value.startswith("-") else value
    if not _DIGITS.fullmatch(body):
        raise UsageError(f"{shown(label, text)}: expected a whole number, e.g. {shown(label, example)}")
    number = int(value)
    if minimum is not None and number < minimum:
        raise UsageError(f"{shown(label, text)}: must be {minimum} or more, e.g. {shown(label, example)}")
    return number


def parse_seconds(text: str, *, label: str, example: str = "30") -> float:
    """A number of seconds in ASCII digits, like 30 or 2.5 (a leading '-' is read, for its message)."""
    value = text.strip()
    body = value[1:] if value.startswith("-") else value
    if not _SECONDS.fullmatch(body):
        raise UsageError(f"{shown(label, text)}: expected a number of seconds, e.g. {shown(label, example)}")
    return float(value)


NPROC_WORDS = ("auto", "gpu", "cpu")


def parse_nproc(item: Given) -> int | str | None:
    """torchrun's --nproc-per-node: a count, or auto|gpu|cpu (resolved by the plan)."""
    if item.text is None:
        return None
    word = item.text.strip().lower()
    if word in NPROC_WORDS:
        return word
    if word == "xpu":
        raise UsageError(f"{item.shown()}: ddprun launches on CUDA GPUs or CPUs: use auto, gpu, cpu or a count")
    return parse_whole(item.text, label=item.label or "--nproc", example="2")


def parse_rdzv_conf(item: Given, *, backend: str) -> dict[str, int]:
    """ "join_timeout=60,last_call_timeout=5" -> {...}; every key known to `backend`, every value whole."""
    if item.text is None or not item.text.strip():
        return {}
    known = RDZV_CONF_KEYS.get(backend) or tuple(dict.fromkeys(k for keys in RDZV_CONF_KEYS.values() for k in keys))
    out: dict[str, int] = {}
    for pair in item.text.split(","):
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"{item.shown()}: expected KEY=VALUE pairs separated by commas, "
                             f"e.g. {shown(item.label or '--rdzv-conf', 'last_call_timeout=5,join_timeout=60')}")
        if key in RDZV_CONF_RESERVED:
            raise UsageError(f"{item.shown()}: ddprun sets {key} itself (it decides who serves the store); drop {key}")
        if key not in known:
            raise UsageError(f"{item.shown()}: unknown key {key} for {backend} rendezvous{_did_you_mean(key, known)}; "
                             f"known: {', '.join(known)}")
        if not _DIGITS.fullmatch(value.strip()) or int(value) < 1:
            raise UsageError(f"{item.shown()}: {key} takes a whole number (seconds or a count) of 1 or more, "
                             f"e.g. {shown(item.label or '--rdzv-conf', f'{key}=30')}")
        out[key] = int(value)
    return out


def parse_streams(item: Given) -> dict[int, int] | int | None:
    """torchrun's --redirects / --tee: "3" (all local ranks) or "0:1,1:2" (per local rank).
    0 none, 1 stdout, 2 stderr, 3 both."""
    if item.text is None:
        return None
    value = item.text.strip()
    if re.fullmatch(r"[0-3]", value):
        return int(value)
    if re.fullmatch(r"[0-9]+:[0-3](,[0-9]+:[0-3])*", value):
        return {int(k): int(v) for k, v in (p.split(":") for p in value.split(","))}
    raise UsageError(f"{item.shown()}: expected 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or LOCAL_RANK:N pairs, "
                     f"e.g. {shown(item.label or '--redirects', '3')} or {shown(item.label or '--redirects', '0:1,1:2')}")


def parse_local_ranks(item: Given) -> tuple[int, ...] | None:
    if item.text is None or not item.text.strip():
        return None
    if not re.fullmatch(r"[0-9]+(,[0-9]+)*", item.text.strip()):
        raise UsageError(f"{item.shown()}: expected local ranks separated by commas, "
                         f"e.g. {shown(item.label or '--local-ranks-filter', '0,1')}")
    return tuple(sorted({int(p) for p in item.text.split(",")}))


def check_prefix_template(item: Given) -> str | None:
    """torch substitutes ${role_name}, ${local_rank}, ${rank}, ${hostname}; anything else is a typo."""
    if item.text is None:
        return None
    try:
        names = {m.group("named") or m.group("braced") for m in string.Template.pattern.finditer(item.text)
                 if not m.group("escaped")}
    except ValueError:
        names = {None}
    unknown = sorted(n or "?" for n in names if n not in PREFIX_MACROS)
    if unknown:
        raise UsageError(f"{item.shown()}: unknown macro ${{{unknown[0]}}}; use "
                         f"{', '.join('${' + m + '}' for m in PREFIX_MACROS)}")
    return item.text


def check_word(item: Given, *, example: str, choices: tuple[str, ...] = ()) -> str | None:
    if item.text is None:
        return None
    value = item.text.strip()
    if choices and value not in choices:
        raise UsageError(f"{item.shown()}: choose from {', '.join(choices)}{_did_you_mean(value, choices)}")
    if not _WORD.fullmatch(value):
        raise UsageError(f"{item.shown()}: use one word, e.g. {shown(item.label or '', example)}")
    return value


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


# --- unknown options -------------------------------------------------------------------------


def _did_you_mean(word: str, known: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def unknown_option(arg: str, *, known: list[str]) -> UsageError:
    """An option before the script that `ddprun run` does not know, with the closest known one."""
    name = arg.split("=", 1)[0]
    spelled = [k for k in known if k.startswith("--")]
    match = _did_you_mean(name, spelled) or _did_you_mean(name.replace("_", "-"), spelled)
    return UsageError(f"unknown option {name}{match}", hint="ddprun run --help lists the options")


# --- what the plan gets ---------------------------------------------------------------------


@dataclass(frozen=True)
class TorchrunChoices:
    """torchrun options that have no older ddprun spelling, checked; None / empty: not given."""

    standalone: bool = False
    rdzv_backend: str | None = None
    rdzv_conf: dict[str, int] = field(default_factory=dict)
    master_addr: str | None = None
    master_port: int | None = None
    local_addr: str | None = None
    no_python: bool = False
    run_path: bool = False
    redirects: dict[int, int] | int | None = None
    tee: dict[int, int] | int | None = None
    local_ranks_filter: tuple[int, ...] | None = None
    log_line_prefix_template: str | None = None
    signals_to_handle: tuple[str, ...] = ()
    passed_through: dict[str, str] = field(default_factory=dict)  # dest -> value for torch's parser
    sources: dict[str, str] = field(default_factory=dict)  # dest -> where it came from


# PET_* variables that name the job's nodes: under SLURM or Kubeflow, ddprun's cluster detection
# reads them itself (Kubeflow sets them; they win there as in torchrun).
_CLUSTER_DESTS = ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint", "rdzv_backend", "rdzv_id")
_UNSUPPORTED = {
    "logs_specs": "ddprun writes every rank's stdout/stderr to its own files; drop --logs-specs",
    "print_completion": "ddprun prints no completion script for torchrun's options; drop --print-completion",
}


def pet_env(env: Mapping[str, str], *, scheduler: str | None) -> dict[str, str]:
    """The PET_* variables read as options: all of them, less the node ones a scheduler's detection reads."""
    skip = {BY_DEST[d].variable for d in _CLUSTER_DESTS} if scheduler else set()
    return {k: v for k, v in env.items() if k.startswith("PET_") and k not in skip}


def choices(given: Mapping[str, Given]) -> TorchrunChoices:
    """torchrun's options without an older ddprun spelling, each checked; refuses what ddprun cannot honour."""
    none = Given(None, None)

    def at(dest: str) -> Given:
        return given.get(dest, none)

    for dest, why in _UNSUPPORTED.items():
        if at(dest).text is not None:
            raise UsageError(f"{at(dest).shown()}: {why}")
    backend = check_word(at("rdzv_backend"), example="c10d")
    if backend is not None and backend not in ("c10d", "static"):
        raise UsageError(f"{at('rdzv_backend').shown()}: ddprun uses c10d or static rendezvous (etcd needs a server "
                         "of its own); e.g. --rdzv-backend c10d")
    port = at("master_port")
    return TorchrunChoices(
        standalone=switch(at("standalone")),
        rdzv_backend=backend,
        rdzv_conf=parse_rdzv_conf(at("rdzv_conf"), backend=backend or "any"),
        master_addr=_host(at("master_addr")),
        master_port=_port(port),
        local_addr=_host(at("local_addr")),
        no_python=switch(at("no_python")),
        run_path=switch(at("run_path")),
        redirects=parse_streams(at("redirects")),
        tee=parse_streams(at("tee")),
        local_ranks_filter=parse_local_ranks(at("local_ranks_filter")),
        log_line_prefix_template=check_prefix_template(at("log_line_prefix_template")),
        signals_to_handle=_signals(at("signals_to_handle")),
        passed_through=_passed_through(at),
        sources={d: g.label for d, g in given.items() if g.label and d in BY_DEST},
    )


def _host(item: Given) -> str | None:
    if item.text is None:
        return None
    value = item.text.strip().strip("[]")  # torchrun writes an IPv6 master address in brackets
    if not value or not re.fullmatch(r"[A-Za-z0-9_.:-]+", value):
        raise UsageError(f"{item.shown()}: expected a host name or IP address, e.g. {shown(item.label or '', '127.0.0.1')}")
    return value


def _port(item: Given) -> int | None:
    if item.text is None:
        return None
    value = item.text.strip()
    if not _DIGITS.fullmatch(value) or not 1 <= int(value) <= 65535:
        raise UsageError(f"{item.shown()}: a port is 1-65535, e.g. {shown(item.label or '--master-port', '29500')}")
    return int(value)


_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's default set: ddprun stops on these too
_EXTRA_SIGNALS = ("SIGUSR1", "SIGUSR2")


def _signals(item: Given) -> tuple[str, ...]:
    """torchrun's --signals-to-handle: the ones beyond the default set (SIGUSR1/SIGUSR2) also stop the job."""
    if item.text is None:
        return ()
    names = [n.strip().upper() for n in item.text.split(",") if n.strip()]
    for name in names:
        if name not in _STOP_SIGNALS + _EXTRA_SIGNALS:
            raise UsageError(f"{item.shown()}: {name} is not one of {', '.join(_STOP_SIGNALS + _EXTRA_SIGNALS)}"
                             f"{_did_you_mean(name, _STOP_SIGNALS + _EXTRA_SIGNALS)}")
    return tuple(n for n in _EXTRA_SIGNALS if n in names)


def _passed_through(at) -> dict[str, str]:
    out: dict[str, str] = {}
    interval = at("monitor_interval")
    if interval.text is not None:
        seconds = parse_seconds(interval.text, label=interval.label or "--monitor-interval", example="0.1")
        if not 0 < seconds <= 3600:
            raise UsageError(f"{interval.shown()}: expected more than 0 and at most 3600 seconds, e.g. --monitor-interval 0.1")
        out["monitor_interval"] = f"{seconds:g}"
    for dest, example, options in (("start_method", "spawn", START_METHODS), ("role", "trainer", ()),
                                   ("event_log_handler", "null", ()), ("numa_binding", "node", NUMA_MODES)):
        value = check_word(at(dest), example=example, choices=options)
        if value is not None:
            out[dest] = value
    for dest in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
        if at(dest).text:
            out[dest] = at(dest).text
    if switch(at("virtual_local_rank")):
        out["virtual_local_rank"] = ""
    return out


@contextlib.contextmanager
def pet_variables_hidden() -> Iterator[None]:
    """While torch's own parser runs: its `env` actions read PET_* unchecked (PET_NO_PYTHON=yes is a
    ValueError traceback), and ddprun has already read them, checked, into the torchrun args."""
    saved = {k: os.environ.pop(k) for k in [k for k in os.environ if k.startswith("PET_")]}
    try:
        yield
    finally:
        os.environ.update(saved)


def stream_shown(*, redirects: dict[int, int] | int | None, tee: dict[int, int] | int | None,
                 local_rank: int, stream: int) -> bool:
    """Does torchrun show this local rank's stream (1 stdout, 2 stderr) on the console?
    Redirected and not teed: no. ddprun writes the log files either way."""

    def has(value: dict[int, int] | int | None) -> bool:
        flags = value.get(local_rank, 0) if isinstance(value, dict) else (value or 0)
        return bool(flags & stream)

    return not has(redirects) or has(tee)


__all__ = [
    "ALL_SPELLINGS", "BY_DEST", "Given", "OPTIONS", "TorchrunChoices", "TorchrunOption", "given_values",
    "parse_nproc", "parse_rdzv_conf", "parse_seconds", "parse_streams", "parse_whole", "shown",
    "stream_shown", "unknown_option",
]
