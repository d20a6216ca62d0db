"""What the shell completes beyond Typer's own: the bundled trainer's options and their values.

`ddprun train` hands the options it does not know to the trainer (train_options), so Typer
cannot see them; `trainer_completions` completes them from the trainer's own definition:
`ddprun train --mo<TAB>` gives --model, `ddprun train --model res<TAB>` the resnets. No torch
import: train_options lists the models without importing torchvision.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ddprun import train_options

# Trainer options whose values are one of a fixed set, by the option's field name.
_VALUE_SETS = {
    "model": "MODEL_CHOICES",
    "data": "DATA_KINDS",
    "optimizer": "OPTIMIZERS",
    "amp": "AMP_CHOICES",
    "grad_compression": "COMPRESSION_CHOICES",
    "grad_allreduce": "ALLREDUCE_CHOICES",
    "lr_schedule": "LR_SCHEDULES",
}


def _flags() -> dict[str, str]:
    """Each trainer flag -> its field name: --model, --channels-last and --no-channels-last."""
    flags = {}
    for field in dataclasses.fields(train_options.TrainOptions):
        flag = "--" + field.name.replace("_", "-")
        flags[flag] = field.name
        if field.type in (bool, "bool"):
            flags["--no-" + field.name.replace("_", "-")] = field.name
    return flags


def trainer_completions(words: Sequence[str], incomplete: str) -> list[tuple[str, str]]:
    """(value, help) pairs for the word being typed after `ddprun train`, given the words before it."""
    flags = _flags()
    if words and words[-1] in flags:
        choices = getattr(train_options, _VALUE_SETS.get(flags[words[-1]], ""), ())
        return [(c, "") for c in choices if c.startswith(incomplete)]
    if incomplete.startswith("-"):
        return [(flag, "trainer option") for flag in flags if flag.startswith(incomplete)]
    return []
