"""Defaults from a file: `[tool.ddprun]` in the nearest pyproject.toml, or a ddprun.toml.

The file is searched upward from the working directory; in each folder a `ddprun.toml` (its
top level is the table) comes before a `pyproject.toml` with a `[tool.ddprun]` table, and a
pyproject.toml without one is passed over (as ruff and mypy do). Keys are the options' names,
with `_` or `-`: `nproc = 2`, `max-restarts = 1`, `log_dir = "logs"`, `forward_signal =
["SIGUSR1"]`, `cpu = true`. A top-level key applies to every command with that option; a
`[tool.ddprun.<command>]` table (`run`, `train`, `doctor`) sets one command's and wins.

The CLI hands the result to click as its `default_map`, which gives the precedence
flag > DDPRUN_* variable > file > built-in default. This module knows nothing of click: the
CLI describes each command's options (`OptionSpec`) and gets plain dicts back. Reading the
file costs no torch import: tomllib (tomli before Python 3.11) only.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ddprun.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.9/3.10 only
    import tomli as tomllib

PYPROJECT = "pyproject.toml"
OWN_FILE = "ddprun.toml"
TABLE = ("tool", "ddprun")


@dataclass(frozen=True)
class OptionSpec:
    """What the file may set for one option: its name, the names it answers to, its kind."""

    name: str  # the Python parameter name: nproc, max_restarts, as_json
    aliases: tuple[str, ...]  # long flags without dashes, `-` as `_`: json for --json
    kind: str  # "flag" (true/false), "multiple" (a list), "value" (a string or a number)


@dataclass(frozen=True)
class ConfigFile:
    path: Path
    in_pyproject: bool  # the table is [tool.ddprun] of a pyproject.toml, else a whole ddprun.toml
    table: dict[str, Any]
    text: str

    @property
    def label(self) -> str:
        """Where a value came from, for the plan's `source` map: "pyproject.toml [tool.ddprun]"."""
        try:
            shown = os.path.relpath(self.path)
        except ValueError:
            shown = str(self.path)
        shown = shown if not shown.startswith("..") else str(self.path)
        return f"{shown} [tool.ddprun]" if self.in_pyproject else shown

    def key_label(self, command: str | None, name: str, opts: Sequence[str]) -> str:
        """Where an option's value was set, as a source label: "pyproject.toml [tool.ddprun] nproc"."""
        key, table = _key_in_file(self, command, name, opts)
        where = self.label if table is None or not self.in_pyproject else f"{self.label[:-1]}.{table}]"
        if table is not None and not self.in_pyproject:
            where = f"{self.label} [{table}]"
        return f"{where} {key or name}"

    def header(self, command: str | None) -> str:
        """The TOML header of the table holding a key: [tool.ddprun], [tool.ddprun.run], [run]."""
        parts = [*(TABLE if self.in_pyproject else ()), *([command] if command else [])]
        return "[" + ".".join(parts) + "]" if parts else ""


# --- finding and reading the file -----------------------------------------------------------


def find(start: Path) -> ConfigFile | None:
    """The nearest configuration at or above `start`, read and parsed; None when there is none."""
    for folder in (start, *start.parents):
        own = folder / OWN_FILE
        if own.is_file():
            text = _read(own)
            return ConfigFile(own, False, _parse(own, text), text)
        pyproject = folder / PYPROJECT
        if pyproject.is_file():
            text = _read(pyproject)
            if "ddprun" not in text:  # cheap: no parse for a project that never names ddprun
                continue
            table = _parse(pyproject, text)
            for key in TABLE:
                table = table.get(key) if isinstance(table, dict) else None
            if isinstance(table, dict):
                return ConfigFile(pyproject, True, table, text)
            if table is not None:
                raise UsageError(f"{pyproject}: [tool.ddprun] must be a table of options, e.g. nproc = 2")
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"{path}: cannot read it ({error})") from None


def _parse(path: Path, text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        # The message ends "(at line L, column C)": the file's name makes it actionable.
        raise UsageError(f"{path}: invalid TOML: {error}") from None


# --- from the file to click's default_map -----------------------------------------------------


def default_map(config: ConfigFile, commands: Mapping[str, Sequence[OptionSpec]]) -> dict[str, dict[str, Any]]:
    """{command: {parameter name: value}}, checked against the commands' options.

    A key no command has, a value of the wrong kind, or a table for no command is a UsageError
    that names the file, the line and the key.
    """
    out: dict[str, dict[str, Any]] = {name: {} for name in commands}
    shared = {k: v for k, v in config.table.items() if not (isinstance(v, dict) and k in commands)}
    for key, value in shared.items():
        if isinstance(value, dict):
            raise _bad_key(config, None, key, f"is not an option nor a command's table (commands: {', '.join(commands)})")
        found = {name: _lookup(specs, key) for name, specs in commands.items()}
        found = {name: spec for name, spec in found.items() if spec is not None}
        if not found:
            raise _bad_key(config, None, key, _unknown(key, [s for specs in commands.values() for s in specs]))
        for name, spec in found.items():
            out[name][spec.name] = _checked(config, None, key, value, spec)
    for command, table in config.table.items():
        if not (isinstance(table, dict) and command in commands):
            continue
        for key, value in table.items():
            spec = _lookup(commands[command], key)
            if spec is None:
                raise _bad_key(config, command, key, _unknown(key, commands[command], command=command))
            out[command][spec.name] = _checked(config, command, key, value, spec)
    return {name: values for name, values in out.items() if values}


def _lookup(specs: Sequence[OptionSpec], key: str) -> OptionSpec | None:
    wanted = key.replace("-", "_")
    return next((s for s in specs if wanted == s.name or wanted in s.aliases), None)


def _unknown(key: str, specs: Sequence[OptionSpec], *, command: str | None = None) -> str:
    where = f"ddprun {command}" if command else "any ddprun command"
    names = sorted({s.aliases[0] if s.aliases else s.name for s in specs})
    close = difflib.get_close_matches(key.replace("-", "_"), names, n=1)
    return f"is not an option of {where}; " + (f"did you mean {close[0]}?" if close else f"known keys: {', '.join(names)}")


def _checked(config: ConfigFile, command: str | None, key: str, value: Any, spec: OptionSpec) -> Any:
    """The value as click takes it from a default_map: options are strings, flags booleans."""
    if spec.kind == "flag":
        if not isinstance(value, bool):
            raise _bad_key(config, command, key, f"= {_toml(value)}: expected true or false")
        return value
    if spec.kind == "multiple":
        items = value if isinstance(value, list) else [value]
        if not all(_is_scalar(v) for v in items):
            raise _bad_key(config, command, key, f"= {_toml(value)}: expected a list of strings or numbers, e.g. [\"SIGUSR1\"]")
        return [str(v) for v in items]
    if not _is_scalar(value):
        raise _bad_key(config, command, key, f"= {_toml(value)}: expected a string or a number")
    return str(value)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{...}"
    return repr(value) if not isinstance(value, str) else f'"{value}"'


def _bad_key(config: ConfigFile, command: str | None, key: str, problem: str) -> UsageError:
    line = key_line(config.text, header=config.header(command), key=key)
    at = f", line {line}" if line else ""
    table = f"{config.header(command)} " if command else ""
    return UsageError(f"{config.path}{at}: {table}{key} {problem}")


def as_text(value: Any) -> str | None:
    """A click value as the CLI's raw option text: a flag is "1", a list joined with commas."""
    if value is None or value is False:
        return None
    if value is True:
        return "1"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or None
    return str(value)


def _key_in_file(config: ConfigFile, command: str | None, name: str, opts: Sequence[str]) -> tuple[str | None, str | None]:
    """The key as written in the file, and the command table holding it (None: the top level)."""
    accepted = {name, *(o.lstrip("-").replace("-", "_") for o in opts if o.startswith("--"))}
    own = config.table.get(command) if command else None
    for table, where in ((own if isinstance(own, dict) else {}, command), (config.table, None)):
        for key in table:
            if key.replace("-", "_") in accepted and not isinstance(table[key], dict):
                return key, where
    return None, None


_HEADER = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")


def key_line(text: str, *, header: str, key: str) -> int | None:
    """The 1-based line of `key = ...` inside the table `header` ("" for the top level)."""
    wanted = re.compile(r"^\s*(" + re.escape(key) + r"|\"" + re.escape(key) + r"\"|'" + re.escape(key) + r"')\s*=")
    target = header.strip("[]").replace(" ", "")
    current = ""
    for number, line in enumerate(text.splitlines(), start=1):
        match = _HEADER.match(line)
        if match:
            current = match.group(1).replace(" ", "").replace('"', "")
        if match and current == f"{target}.{key}".lstrip("."):  # a table where an option was expected
            return number
        if not match and current == target and wanted.match(line):
            return number
    return None
