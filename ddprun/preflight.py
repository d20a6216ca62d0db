"""Checks of the user's input that need a look at the file system or a parse of a raw string.

They run before the plan is built, so a mistake exits 2 with nothing started.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from importlib.machinery import PathFinder

from ddprun import runfolders, torchrun_compat
from ddprun.errors import UsageError
from ddprun.plan import Entrypoint

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def check_entrypoint(entrypoint: Entrypoint, *, known_options: list[str] | None = None) -> Entrypoint:
    """The script, module or program exists and can be run, checked before anything starts.

    A SCRIPT that starts with "-" is an option ddprun does not know: click passes unknown options
    on as the first argument (ignore_unknown_options), so this is where they are named."""
    target = entrypoint.target
    if target.startswith("-") and target != "-":
        raise torchrun_compat.unknown_option(target, known=known_options or [])
    if entrypoint.is_module and entrypoint.no_python:
        raise UsageError("--no-python and -m exclude each other (as in torchrun): a module needs python")
    if entrypoint.is_module:
        if not _MODULE_NAME.match(target):
            raise UsageError(f"-m {target}: not a module name; use a dotted name like -m mypkg.train")
        return _check_module(entrypoint)
    if entrypoint.no_python:
        return _check_program(entrypoint)
    if os.path.isdir(target):
        raise UsageError(f"{target} is a directory, not a script; name the script, e.g. ddprun run {os.path.join(target, 'train.py')}")
    if not os.path.isfile(target):
        hint = "to run a module, use -m, e.g. ddprun run -m mypkg.train" if "/" not in target and not target.endswith(".py") else None
        raise UsageError(f"{target}: no such script", hint=hint)
    if not os.access(target, os.R_OK):
        raise UsageError(f"{target}: not readable by you; check its permissions (ls -l {target})")
    return entrypoint


def _check_module(entrypoint: Entrypoint) -> Entrypoint:
    """Find -m's module as the workers will (working directory first), without importing any of it."""
    path: list[str] | None = [os.getcwd(), *sys.path]
    found = None
    for part in entrypoint.target.split("."):
        found = PathFinder.find_spec(part, path) if path is not None else None
        if found is None:
            break
        path = list(found.submodule_search_locations or []) or None
    if found is None and entrypoint.target not in sys.builtin_module_names:
        raise UsageError(f"-m {entrypoint.target}: no such module in {os.getcwd()} or the installed packages; "
                         "run from the folder that holds it, or pip install it")
    return entrypoint


def _check_program(entrypoint: Entrypoint) -> Entrypoint:
    """--no-python: a program the workers execute, found as execvp finds it."""
    target = entrypoint.target
    found = target if "/" in target else shutil.which(target)
    if found is None or not os.path.isfile(found):
        raise UsageError(f"--no-python {target}: no such program" + ("" if "/" in target else " on PATH"))
    if not os.access(found, os.X_OK):
        raise UsageError(f"--no-python {target}: not executable; chmod +x {target}, or drop --no-python for a python script")
    return entrypoint


def script_args(args: list[str] | None) -> tuple[str, ...]:
    """The script's arguments: a `--` right after the script only separates; any later one is the script's."""
    args = list(args or ())
    return tuple(args[1:] if args[:1] == ["--"] else args)


def check_log_dir(log_dir: str | None) -> str | None:
    """The absolute --log-dir, if ddprun can make its job folder there; creates nothing."""
    if log_dir is None:
        return None
    problem = runfolders.folder_problem(log_dir)
    if problem:
        raise UsageError(f"--log-dir {log_dir}: {problem}; give a folder you can write, e.g. --log-dir ./logs")
    return os.path.abspath(log_dir)


def parse_int(text: str | None, *, flag: str, example: str) -> int | None:
    """A whole number in ASCII digits; `flag` may be a variable's name (DDPRUN_X, PET_X), shown as X=text."""
    if text is None:
        return None
    return torchrun_compat.parse_whole(text, label=flag, example=example)


def parse_seconds(text: str | None, *, flag: str) -> float | None:
    """Seconds in ASCII digits, like 30 or 2.5 (no inf, nan, 1_0 or full-width digits)."""
    if text is None:
        return None
    return torchrun_compat.parse_seconds(text, label=flag)


def parse_ranks(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    if not re.fullmatch(r"-?[0-9]+(,-?[0-9]+)*", text.strip()):
        raise UsageError(f"--ranks {text}: expected global ranks separated by commas, e.g. --ranks 0,3")
    return tuple(int(part) for part in text.split(","))


def check_gpus(text: str | None, *, flag: str = "--gpus") -> str | None:
    """--gpus in ASCII: a count, all, or ordinals; "1," (one ordinal) is the only trailing comma."""
    if text is None:
        return None
    value = text.strip()
    if value.lower() == "all" or re.fullmatch(r"-?[0-9]+,?", value) or re.fullmatch(r"[0-9]+(,[0-9]+)+", value):
        return text
    raise UsageError(f"{torchrun_compat.shown(flag, text)}: expected a count N, all, or ordinals like 0,2 "
                     f"(ASCII digits, no empty entry), e.g. {torchrun_compat.shown(flag, '0,1')}")
