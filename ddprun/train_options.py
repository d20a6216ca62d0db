"""Options of the bundled trainer: one frozen value, checked before any process starts.

This module must stay importable without torch: the CLI uses it for --help and
--dry-run. The worker receives the options as argv (`to_argv`) and parses them
back with `from_argv`, so both sides agree on one definition.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Optional, Sequence

from ddprun import runfolders
from ddprun.errors import UsageError

SMALL_MODELS = ("mlp", "cnn")
# torchvision classification models known to train here, listed without importing torchvision.
TORCHVISION_MODELS = (
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "wide_resnet50_2", "resnext50_32x4d",
    "mobilenet_v2", "mobilenet_v3_small", "mobilenet_v3_large",
    "efficientnet_b0", "efficientnet_b1", "efficientnet_v2_s",
    "regnet_y_400mf", "regnet_y_800mf",
    "convnext_tiny", "convnext_small",
    "densenet121", "shufflenet_v2_x1_0", "squeezenet1_1",
    "vgg11_bn", "vgg16_bn", "alexnet",
    "vit_b_16", "vit_b_32", "swin_t", "swin_v2_t",
)
MODEL_CHOICES = SMALL_MODELS + TORCHVISION_MODELS

# Smallest --image-size each model's downsampling survives (measured); 8 otherwise, 4 for mlp/cnn.
_MIN_IMAGE_SIZE = {
    "mlp": 4, "cnn": 4,
    "convnext_tiny": 32, "convnext_small": 32, "densenet121": 32,
    "squeezenet1_1": 32, "vgg11_bn": 32, "vgg16_bn": 32, "alexnet": 64,
}
# Vision transformers cut the image into patches of this size.
_PATCH_SIZE = {"vit_b_16": 16, "vit_b_32": 32}

DATA_KINDS = ("synthetic", "fake")
OPTIMIZERS = ("sgd", "adamw")
AMP_CHOICES = ("off", "bf16", "fp16")
COMPRESSION_CHOICES = ("none", "bf16", "fp16", "powersgd")
# auto: shared memory when every rank trains on this host's CPU, else the backend's (gloo, nccl) all-reduce
ALLREDUCE_CHOICES = ("auto", "shm", "backend")
# cosine: linear warmup, then cosine decay to zero; step: x0.1 after each third of the run (torchvision's 30/60
# of 90 epochs); constant: the warmup, then the same lr to the end.
LR_SCHEDULES = ("cosine", "step", "constant")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
CHECKPOINT_NAME = "last.pt"
BEST_CHECKPOINT_NAME = "best.pt"  # the checkpoint of the best validation accuracy so far
# Upper bounds that keep a value usable by what receives it (timedelta, int(bytes), a store's wait).
MAX_COLLECTIVE_TIMEOUT_S = 7 * 24 * 3600.0
MAX_BUCKET_CAP_MB = 1e5


@dataclass(frozen=True)
class TrainOptions:
    """Every option of `ddprun train`'s worker. None means "the sensible default for this run"."""

    model: str = "resnet18"
    data: str = "synthetic"  # synthetic | fake | PATH to an ImageFolder tree
    image_size: int = 224
    num_classes: Optional[int] = None  # None: inferred from PATH, else 1000
    dataset_size: int = 2048  # samples per epoch for synthetic and fake data
    epochs: int = 1
    max_steps: Optional[int] = None  # optimizer steps; stops early when reached
    batch_size: int = 32  # per process
    lr: Optional[float] = None  # None: sgd 0.1 x global batch / 256 (the linear rule), adamw 0.001
    optimizer: str = "sgd"  # sgd: with momentum 0.9
    weight_decay: Optional[float] = None  # None: 1e-4 for sgd, 0.05 for adamw
    lr_schedule: str = "cosine"
    warmup_epochs: Optional[float] = None  # linear warmup; None (and no --warmup-steps): auto, see schedule.py
    warmup_steps: Optional[int] = None
    label_smoothing: float = 0.1
    clip_grad_norm: Optional[float] = None  # max total gradient norm; None: no clipping
    hflip: bool = True  # random horizontal flips of ImageFolder training images
    amp: str = "off"
    channels_last: bool = False
    compile: bool = False
    grad_accum: int = 1
    sync_bn: bool = False
    workers: int = 2
    seed: int = 0
    checkpoint_dir: Optional[str] = None
    resume: bool = False
    save_every: str = "1epoch"  # N (optimizer steps) or Nepoch(s)
    metrics_json: Optional[str] = None
    log_interval: float = 10.0  # seconds between plain progress lines
    bucket_cap_mb: float = 25.0
    grad_compression: str = "none"
    grad_allreduce: str = "auto"
    static_graph: bool = False
    collective_timeout: float = 300.0  # seconds

    @property
    def checkpoint_path(self) -> Optional[str]:
        if self.checkpoint_dir is None:
            return None
        return os.path.join(self.checkpoint_dir, CHECKPOINT_NAME)

    @property
    def best_checkpoint_path(self) -> Optional[str]:
        return None if self.checkpoint_dir is None else os.path.join(self.checkpoint_dir, BEST_CHECKPOINT_NAME)

    @property
    def is_path_data(self) -> bool:
        return self.data not in DATA_KINDS

    @property
    def save_interval(self) -> "SaveEvery":
        return parse_save_every(self.save_every)


@dataclass(frozen=True)
class SaveEvery:
    count: int
    unit: str  # "steps" | "epochs"


def parse_save_every(text: str) -> SaveEvery:
    """`500` or `500steps`: every 500 optimizer steps; `1epoch`, `2epochs`: at the end of every N-th epoch."""
    match = re.fullmatch(r"\s*(\d+)\s*(steps?|epochs?)?\s*", str(text).lower())
    if match is None or int(match[1]) < 1:
        raise UsageError(f"--save-every {text} is invalid: it must be a number of optimizer steps "
                         f"or of epochs, at least 1", hint="e.g. --save-every 500 or --save-every 1epoch")
    return SaveEvery(int(match[1]), "epochs" if (match[2] or "").startswith("epoch") else "steps")


_FIELDS = {f.name: f for f in dataclasses.fields(TrainOptions)}
_DEFAULTS = TrainOptions()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_type(name: str) -> type:
    annotation = str(_FIELDS[name].type)
    for kind in (bool, int, float, str):
        if kind.__name__ in annotation:
            return kind
    raise TypeError(f"unsupported option type {annotation!r} for {name}")


def to_argv(opts: TrainOptions) -> list[str]:
    """The worker's argv for `opts`: only values that differ from the defaults, in field order."""
    argv: list[str] = []
    for name in _FIELDS:
        value = getattr(opts, name)
        if value == getattr(_DEFAULTS, name):
            continue
        if isinstance(value, bool):
            argv.append(_flag(name) if value else "--no-" + name.replace("_", "-"))
        elif value is None:
            argv.append(f"{_flag(name)}=none")
        else:
            # --flag=value keeps values that start with "-" (paths) from reading as flags
            argv.append(f"{_flag(name)}={value!r}" if isinstance(value, float) else f"{_flag(name)}={value}")
    return argv


def _optional(kind: type):
    def parse(text: str):
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddprun.worker.train", description="ddprun's bundled DDP trainer")
    for name, field in _FIELDS.items():
        kind = _field_type(name)
        if kind is bool:
            parser.add_argument(_flag(name), action=argparse.BooleanOptionalAction, default=field.default)
        elif "Optional" in str(field.type):
            parser.add_argument(_flag(name), type=_optional(kind), default=field.default)
        else:
            parser.add_argument(_flag(name), type=kind, default=field.default)
    return parser


def from_argv(argv: Sequence[str]) -> TrainOptions:
    """Parse the worker's argv (as written by `to_argv`); argparse exits 2 on malformed input."""
    namespace = build_parser().parse_args(list(argv))
    return TrainOptions(**vars(namespace))


def validate(opts: TrainOptions, *, world_size: Optional[int] = None) -> None:
    """Raise UsageError for anything that would fail after processes start.

    `world_size`, when known, also checks that synthetic/fake data gives every
    process at least one full step per epoch.
    """
    _check_numbers(opts)
    _check_floats(opts)
    _check_schedule(opts)
    _check_choices(opts)
    _check_image_size(opts)
    if opts.is_path_data:
        _check_image_folder(opts)
    _check_run_control(opts)
    if world_size is not None:
        _check_world(opts, world_size)


def _positive(value, flag: str, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = "0 or more" if allow_zero else "at least 1" if isinstance(value, int) else "greater than 0"
        raise UsageError(f"{flag} {value} is invalid: it must be {bound}")


def _check_numbers(opts: TrainOptions) -> None:
    for name in ("image_size", "num_classes", "dataset_size", "epochs", "max_steps", "batch_size",
                 "grad_accum"):
        _positive(getattr(opts, name), _flag(name))
    _positive(opts.workers, "--workers", allow_zero=True)
    _positive(opts.warmup_steps, "--warmup-steps", allow_zero=True)
    opts.save_interval  # parses, or raises UsageError
    if opts.num_classes == 1:
        raise UsageError("--num-classes 1 is invalid: classification needs at least 2 classes")
    if not 0 <= opts.seed < 2**32:
        raise UsageError(f"--seed {opts.seed} is invalid: it must be between 0 and {2**32 - 1}")


# Every float option: (lowest, highest, is the lowest itself allowed); None: no bound. NaN and inf never are.
_FLOAT_RANGES = {
    "lr": (0.0, None, False),
    "weight_decay": (0.0, None, True),
    "warmup_epochs": (0.0, None, True),
    "label_smoothing": (0.0, 1.0, True),  # 1 would spread every label evenly: nothing left to learn
    "clip_grad_norm": (0.0, None, False),
    "log_interval": (0.0, None, False),
    "bucket_cap_mb": (0.0, MAX_BUCKET_CAP_MB, False),
    "collective_timeout": (0.0, MAX_COLLECTIVE_TIMEOUT_S, False),
}


def _check_floats(opts: TrainOptions) -> None:
    for name, (low, high, low_ok) in _FLOAT_RANGES.items():
        value = getattr(opts, name)
        if value is None:
            continue
        below = value < low or (value == low and not low_ok)
        above = high is not None and (value >= high if name == "label_smoothing" else value > high)
        if not math.isfinite(value) or below or above:
            raise UsageError(f"{_flag(name)} {value} is invalid: it must be a finite number "
                             f"{_range_text(low, high, low_ok, name)}")


def _range_text(low: float, high: Optional[float], low_ok: bool, name: str) -> str:
    lowest = f"{'at least' if low_ok else 'greater than'} {low:g}"
    if high is None:
        return lowest
    return f"{lowest} and {'below' if name == 'label_smoothing' else 'at most'} {high:g}"


def _check_schedule(opts: TrainOptions) -> None:
    if opts.warmup_epochs is not None and opts.warmup_steps is not None:
        raise UsageError("--warmup-epochs and --warmup-steps both set the warmup", hint="give one of them")
    if opts.warmup_epochs is not None and opts.warmup_epochs >= opts.epochs:
        raise UsageError(f"--warmup-epochs {opts.warmup_epochs:g} is not shorter than the run (--epochs "
                         f"{opts.epochs})", hint="use a shorter warmup, or more --epochs")


def _check_choices(opts: TrainOptions) -> None:
    if opts.model not in MODEL_CHOICES:
        raise UsageError(f"unknown model {opts.model!r}", hint="choose one of: " + ", ".join(MODEL_CHOICES))
    for flag, value, choices in (("--optimizer", opts.optimizer, OPTIMIZERS), ("--amp", opts.amp, AMP_CHOICES),
                                 ("--grad-compression", opts.grad_compression, COMPRESSION_CHOICES),
                                 ("--grad-allreduce", opts.grad_allreduce, ALLREDUCE_CHOICES),
                                 ("--lr-schedule", opts.lr_schedule, LR_SCHEDULES)):
        if value not in choices:
            raise UsageError(f"{flag} {value!r} is not one of: {', '.join(choices)}")
    if opts.grad_allreduce == "shm" and opts.grad_compression != "none":
        raise UsageError(f"--grad-allreduce shm averages full-precision gradients; it cannot send "
                         f"--grad-compression {opts.grad_compression}",
                         hint="drop one of them (on one host, shm is the faster of the two)")


def _check_image_size(opts: TrainOptions) -> None:
    smallest = _MIN_IMAGE_SIZE.get(opts.model, 8)
    if opts.image_size < smallest:
        raise UsageError(f"--image-size {opts.image_size} is too small for {opts.model}",
                         hint=f"use --image-size {smallest} or more")
    patch = _PATCH_SIZE.get(opts.model)
    if patch and opts.image_size % patch:
        size = max(patch, opts.image_size // patch * patch)
        raise UsageError(f"--image-size {opts.image_size} is not a multiple of {opts.model}'s patch size {patch}",
                         hint=f"use --image-size {size}")


def _check_run_control(opts: TrainOptions) -> None:
    if opts.checkpoint_dir is not None:
        _check_checkpoint_dir(opts.checkpoint_dir)
    if opts.resume:
        if opts.checkpoint_dir is None:
            raise UsageError("--resume needs --checkpoint-dir DIR (the directory holding last.pt)")
        if not os.path.isfile(opts.checkpoint_path):
            raise UsageError(f"--resume: no checkpoint at {opts.checkpoint_path}",
                             hint="run without --resume first, or point --checkpoint-dir at the run's directory")
    if opts.metrics_json is not None:
        parent = os.path.dirname(os.path.abspath(opts.metrics_json))
        if not os.path.isdir(parent):
            raise UsageError(f"--metrics-json {opts.metrics_json}: directory {parent} does not exist")


def _check_checkpoint_dir(path: str) -> None:
    """The directory exists and is writable, or can be created. Nothing is created here (--dry-run
    runs these checks too); the first save creates it."""
    problem = runfolders.folder_problem(path)
    if problem:
        raise UsageError(f"--checkpoint-dir {path}: {problem}",
                         hint="point --checkpoint-dir at a directory you can write to")


def steps_per_epoch(opts: TrainOptions, world_size: int) -> int:
    """Optimizer steps per epoch of synthetic or fake data (DistributedSampler pads to equal shards)."""
    return -(-opts.dataset_size // world_size) // opts.batch_size // opts.grad_accum


def _check_world(opts: TrainOptions, world_size: int) -> None:
    if opts.is_path_data:
        return  # counting files of a large tree is the worker's job
    per_step = world_size * opts.batch_size * opts.grad_accum
    if opts.dataset_size < per_step:
        raise UsageError(
            f"--dataset-size {opts.dataset_size} is smaller than one step of {per_step} samples "
            f"(world size {world_size} x --batch-size {opts.batch_size} x --grad-accum {opts.grad_accum})",
            hint=f"use --dataset-size {per_step} or more, or a smaller --batch-size or --grad-accum",
        )
    check_warmup_steps(opts, schedule_steps=opts.epochs * steps_per_epoch(opts, world_size))


def check_warmup_steps(opts: TrainOptions, *, schedule_steps: int) -> None:
    """An explicit --warmup-steps shorter than the schedule (--epochs x steps per epoch)."""
    if opts.warmup_steps is not None and opts.warmup_steps >= schedule_steps:
        raise UsageError(f"--warmup-steps {opts.warmup_steps} is not shorter than the run ({schedule_steps} "
                         f"steps over --epochs {opts.epochs})", hint="use a shorter warmup, or more --epochs")


def image_folder_roots(data: str) -> tuple[str, Optional[str]]:
    """(train root, val root or None) of an ImageFolder tree: PATH/train + PATH/val, or PATH itself."""
    train = os.path.join(data, "train")
    if os.path.isdir(train):
        val = os.path.join(data, "val")
        return train, (val if os.path.isdir(val) else None)
    return data, None


def _check_image_folder(opts: TrainOptions) -> None:
    if not os.path.exists(opts.data):
        raise UsageError(f"--data {opts.data}: no such directory",
                         hint="use --data synthetic, --data fake, or a path to an ImageFolder tree")
    if not os.path.isdir(opts.data):
        raise UsageError(f"--data {opts.data} is not a directory (expected an ImageFolder tree)")
    _check_readable(opts.data)
    train, val = image_folder_roots(opts.data)
    classes = class_folders(train)
    if opts.num_classes is not None and opts.num_classes != len(classes):
        raise UsageError(f"--num-classes {opts.num_classes} does not match the {len(classes)} class folders "
                         f"in {train}", hint="leave --num-classes out: it is inferred from the tree")
    if val is not None and class_folders(val) != classes:
        raise UsageError(f"{val} and {train} have different class folders",
                         hint="give val/ the same class subfolders as train/")


def class_folders(root: str) -> list[str]:
    """Sorted class folder names of an ImageFolder root; UsageError when it is empty or a class has no image."""
    _check_readable(root)
    names = sorted(entry.name for entry in os.scandir(root) if entry.is_dir() and not entry.name.startswith("."))
    if not names:
        raise UsageError(f"--data: {root} has no class folders",
                         hint="an ImageFolder tree looks like ROOT/train/CLASS/image.png (or ROOT/CLASS/image.png)")
    for name in names:
        _check_readable(os.path.join(root, name))
        if not _has_image(os.path.join(root, name)):
            raise UsageError(f"--data: class folder {os.path.join(root, name)} holds no image files",
                             hint="image files end in " + " ".join(IMAGE_EXTENSIONS))
    return names


def _check_readable(folder: str) -> None:
    if not os.access(folder, os.R_OK | os.X_OK):
        raise UsageError(f"--data: {folder} is not readable", hint="check its permissions (it needs r and x)")


def _has_image(folder: str) -> bool:
    """True at the first image found (ImageFolder also looks into subfolders), so large trees stay quick."""
    for dirpath, _dirnames, filenames in os.walk(folder, followlinks=True):
        if any(name.lower().endswith(IMAGE_EXTENSIONS) for name in filenames):
            return True
    return False


# --- the `ddprun train` command line --------------------------------------------------------

WORKER_MODULE = "ddprun.worker.train"
_CHOICES = {"model": "mlp, cnn or a torchvision model", "data": "synthetic, fake or PATH",
            "optimizer": "|".join(OPTIMIZERS), "amp": "|".join(AMP_CHOICES),
            "grad_compression": "|".join(COMPRESSION_CHOICES), "grad_allreduce": "|".join(ALLREDUCE_CHOICES),
            "lr_schedule": "|".join(LR_SCHEDULES), "save_every": "N (steps) or Nepoch(s)"}


def parse_cli(args: Sequence[str]) -> TrainOptions:
    """The trainer options a user typed after `ddprun train`; a mistake is a UsageError (exit 2)."""
    parser = build_parser()
    parser.exit_on_error = False
    parser.allow_abbrev = False  # --epoch must not silently mean --epochs
    try:
        namespace, unknown = parser.parse_known_args(list(args))
    except (argparse.ArgumentError, ValueError) as error:
        raise UsageError(f"ddprun train: {error}") from None
    if unknown:
        raise UsageError(f"ddprun train: unknown option {unknown[0]}; see ddprun train --help")
    return TrainOptions(**vars(namespace))


def options_help() -> str:
    """One line per trainer option, with its default, for `ddprun train --help`."""
    lines = []
    for name, field in _FIELDS.items():
        kind = _field_type(name)
        flag = _flag(name) if kind is not bool else f"{_flag(name)} / --no-{name.replace('_', '-')}"
        what = _CHOICES.get(name, kind.__name__.upper() if kind is not bool else "")
        default = "auto" if field.default is None else field.default
        lines.append(f"  {flag} {what}".rstrip().ljust(44) + f" default: {default}")
    return "\n".join(lines)
