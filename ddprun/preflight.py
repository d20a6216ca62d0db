"""Checks of the user's input that need a look at the file system or a parse of a raw string.

They run before the plan is built, so a mistake exits 2 with nothing started.
"""

from __future__ import annotations

import os
import re

from ddprun.errors import UsageError
from ddprun.plan import Entrypoint

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def check_entrypoint(entrypoint: Entrypoint) -> Entrypoint:
    target = entrypoint.target
    if entrypoint.is_module:
        if not _MODULE_NAME.match(target):
            raise UsageError(f"-m {target}: not a module name; use a dotted name like -m mypkg.train")
        return entrypoint
    if os.path.isdir(target):
        raise UsageError(f"{target} is a directory, not a script; name the script, e.g. ddprun run {os.path.join(target, 'train.py')}")
    if not os.path.isfile(target):
        hint = "to run a module, use -m, e.g. ddprun run -m mypkg.train" if "/" not in target and not target.endswith(".py") else None
        raise UsageError(f"{target}: no such script", hint=hint)
    return entrypoint


def script_args(args: list[str] | None) -> tuple[str, ...]:
    """The script's arguments: a `--` right after the script only separates; any later one is the script's."""
    args = list(args or ())
    return tuple(args[1:] if args[:1] == ["--"] else args)


def check_log_dir(log_dir: str | None) -> str | None:
    """The absolute --log-dir, if ddprun can make its job folder there; creates nothing."""
    if log_dir is None:
        return None
    path = os.path.abspath(log_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--log-dir {log_dir}: this is a file; give a directory, e.g. --log-dir ./logs")
    existing = path
    while not os.path.lexists(existing):  # the folder that would hold what ddprun creates
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"--log-dir {log_dir}: {existing} is not a folder; give a directory, e.g. --log-dir ./logs")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--log-dir {log_dir}: {existing} is not writable by you; give a folder you can write, e.g. --log-dir ./logs")
    return path


def parse_int(text: str | None, *, flag: str, example: str) -> int | None:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{flag} {text}: expected a whole number, e.g. {flag} {example}") from None


def parse_seconds(text: str | None, *, flag: str) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{flag} {text}: expected a number of seconds, e.g. {flag} 30") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise UsageError(f"{flag} {text}: expected a finite number of seconds, e.g. {flag} 30")
    return value


def parse_ranks(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        ranks = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--ranks {text}: expected global ranks separated by commas, e.g. --ranks 0,3") from None
    return ranks
