"""The training recipe: default lr and weight decay, the warmup, and the lr schedule.

Modelled on torchvision's classification reference scripts: SGD with momentum 0.9 at lr 0.1
per 256 images of global batch (the linear scaling rule), weight decay 1e-4, label smoothing 0.1;
a linear warmup, then cosine decay to zero. AdamW keeps lr 0.001 and weight decay 0.05, with the
same warmup and schedule. The schedule is a pure function of the optimizer step, so the
checkpointed scheduler state and the step give back exactly the same lr on resume.
"""

from __future__ import annotations

import math
from typing import Optional

from ddprun.train_options import TrainOptions

SGD_LR_PER_256 = 0.1
SGD_MOMENTUM = 0.9
SGD_WEIGHT_DECAY = 1e-4
ADAMW_LR = 1e-3
ADAMW_WEIGHT_DECAY = 0.05
# Auto warmup: one epoch, but never more than this share of the run.
AUTO_WARMUP_SHARE = 0.1
STEP_DECAY = 0.1  # the step schedule's factor after each third of the run


def default_lr(optimizer: str, *, global_batch: int) -> float:
    if optimizer == "adamw":
        return ADAMW_LR
    return SGD_LR_PER_256 * global_batch / 256


def learning_rate(opts: TrainOptions, *, global_batch: int) -> float:
    return default_lr(opts.optimizer, global_batch=global_batch) if opts.lr is None else opts.lr


def weight_decay(opts: TrainOptions) -> float:
    if opts.weight_decay is not None:
        return opts.weight_decay
    return ADAMW_WEIGHT_DECAY if opts.optimizer == "adamw" else SGD_WEIGHT_DECAY


def warmup_steps(opts: TrainOptions, *, per_epoch: int, horizon: int) -> int:
    """Warmup length in optimizer steps; `horizon` is the schedule's length (--epochs x per_epoch)."""
    if opts.warmup_steps is not None:
        return opts.warmup_steps
    if opts.warmup_epochs is not None:
        return min(round(opts.warmup_epochs * per_epoch), horizon - 1)
    return min(per_epoch, math.ceil(AUTO_WARMUP_SHARE * horizon))


def lr_factor(step: int, *, kind: str, warmup: int, horizon: int) -> float:
    """The multiple of the base lr for optimizer step `step` (0-based) of a `horizon`-step schedule."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, horizon - warmup))
    if kind == "step":
        return STEP_DECAY ** min(2, int(progress * 3))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer, *, kind: str, warmup: int, horizon: int,
                    state: Optional[dict] = None):
    """torch's LambdaLR over `lr_factor`; `state` (a checkpoint's) continues where it stopped."""
    import torch

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, kind=kind, warmup=warmup, horizon=horizon))
    if state is not None:
        scheduler.load_state_dict(state)
    return scheduler
