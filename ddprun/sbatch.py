"""Render a ready-to-submit SLURM batch script that runs one ddprun per node.

Inside the job step each ddprun finds its node rank, the rendezvous host and the job id in
SLURM's variables (see cluster.py), so the command itself needs no node flags.
"""

from __future__ import annotations

import re
import shlex
from typing import Callable, Sequence

from ddprun.errors import UsageError

# The forms SLURM's --time accepts: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"[0-9]+(:[0-9]+){0,2}|[0-9]+-[0-9]+(:[0-9]+){0,2}")
# A directive value must stay one word: sbatch reads "#SBATCH" lines word by word.
_WORD = re.compile(r"[^\s'\"\\#]+")


def _check_count(value: int, *, flag: str, minimum: int, example: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{flag} {value}: expected a whole number >= {minimum}, e.g. {flag} {example}")
    return value


def _check_word(value: str, *, flag: str, example: str) -> str:
    if not _WORD.fullmatch(value):
        raise UsageError(f"{flag} {value!r}: use one word without blanks or quotes, e.g. {flag} {example}")
    return value


def _check_time(value: str) -> str:
    if not _TIME.fullmatch(value):
        raise UsageError(
            f"--time {value!r}: SLURM takes MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, "
            "e.g. --time 04:00:00 or --time 1-12:00:00"
        )
    return value


def _directives(
    *,
    nodes: int,
    gpus_per_node: int,
    job_name: str,
    time: str | None,
    partition: str | None,
    account: str | None,
    cpus_per_task: int | None,
    output: str,
) -> list[str]:
    pairs: list[tuple[str, object]] = [
        ("job-name", _check_word(job_name, flag="--job-name", example="my-run")),
        ("nodes", _check_count(nodes, flag="--nodes", minimum=1, example=2)),
        ("ntasks-per-node", 1),  # one ddprun per node; it starts the per-GPU workers itself
    ]
    if _check_count(gpus_per_node, flag="--gpus-per-node", minimum=0, example=8):
        pairs.append(("gpus-per-node", gpus_per_node))
    if cpus_per_task is not None:
        pairs.append(("cpus-per-task", _check_count(cpus_per_task, flag="--cpus-per-task", minimum=1, example=32)))
    if time is not None:
        pairs.append(("time", _check_time(time)))
    if partition is not None:
        pairs.append(("partition", _check_word(partition, flag="--partition", example="gpu")))
    if account is not None:
        pairs.append(("account", _check_word(account, flag="--account", example="my-project")))
    pairs.append(("output", _check_word(output, flag="--output", example="logs/%x-%j.out")))
    return [f"#SBATCH --{name}={value}" for name, value in pairs]


def _srun_line(*, ddprun_args: Sequence[str], cpus_per_task: int | None) -> str:
    if not ddprun_args:
        raise UsageError("no ddprun command to run in the job: give one, e.g. train --gpus 8")
    srun = ["srun", "--ntasks-per-node=1"]
    if cpus_per_task is not None:
        # Some SLURM releases (22.05) do not pass sbatch's --cpus-per-task on to srun; say it again.
        srun.append(f"--cpus-per-task={cpus_per_task}")
    # If one node's ddprun fails, end the step on every node instead of leaving them waiting.
    srun.append("--kill-on-bad-exit=1")
    return " ".join(srun + ["ddprun"] + [shlex.quote(str(arg)) for arg in ddprun_args])


INNER_COMMANDS = ("run", "train")


def check_inner_command(args: Sequence[str], *, parse: Callable[[list[str]], None]) -> None:
    """The ddprun command every node runs, checked here: a typo would otherwise wait in the queue
    and fail on every node. `parse` parses it as that command would (the CLI's own parser)."""
    if not args:
        return  # render_sbatch says what to give
    if args[0] not in INNER_COMMANDS:
        raise UsageError(f"ddprun sbatch -- {args[0]}: each node runs ddprun run or ddprun train, "
                         "e.g. ddprun sbatch --nodes 2 -- train --epochs 10")
    try:
        parse(list(args))
    except UsageError as err:
        raise UsageError(f"ddprun sbatch -- {shlex.join(args)}: {err.message}", hint=err.hint) from None


def render_sbatch(
    *,
    nodes: int,
    gpus_per_node: int,
    ddprun_args: Sequence[str],
    job_name: str = "ddprun",
    time: str | None = None,
    partition: str | None = None,
    account: str | None = None,
    cpus_per_task: int | None = None,
    output: str | None = None,
) -> str:
    """The text of an sbatch script; `sbatch` it as is. Raises UsageError on bad values."""
    directives = _directives(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        job_name=job_name,
        time=time,
        partition=partition,
        account=account,
        cpus_per_task=cpus_per_task,
        output="%x-%j.out" if output is None else output,
    )
    lines = [
        "#!/bin/bash",
        *directives,
        "",
        "# One ddprun per node: each reads its node rank, the rendezvous host (the first node)",
        "# and the rendezvous id (the job id) from SLURM's variables.",
        "set -euo pipefail",
        "",
        _srun_line(ddprun_args=ddprun_args, cpus_per_task=cpus_per_task),
    ]
    return "\n".join(lines) + "\n"


__all__ = ["render_sbatch"]
