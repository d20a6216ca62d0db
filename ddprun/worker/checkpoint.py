"""Checkpoints that survive kill -9 and load with `weights_only=True`.

`save_atomic` writes a temp file in the same directory, flushes and fsyncs it,
renames it over the target with `os.replace` and fsyncs the directory, so the
target is always either the previous complete checkpoint or the new one.
Everything stored is tensors, plain containers and primitives, so `torch.load`
never needs to unpickle arbitrary objects. `load_checkpoint` checks the whole structure (keys,
types, lengths) before anything uses it, and names the first thing that is wrong.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pickle
import random
import re
import tempfile
from typing import Any, Optional

import torch

FORMAT_VERSION = 2  # 2: the lr schedule's state and the best validation accuracy
REQUIRED_KEYS = ("format", "model", "optimizer", "scaler", "schedule", "epoch", "batch_in_epoch", "step",
                 "world_size", "rng", "args", "best_val_accuracy")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file."""


def save_atomic(obj: Any, path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    # Makes the rename itself durable; some filesystems refuse fsync on a directory.
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temps(path: str) -> None:
    """Delete temp files left by a writer that was killed mid-save."""
    pattern = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.*.tmp")
    for stale in glob.glob(pattern):
        with contextlib.suppress(OSError):
            os.unlink(stale)


def load_checkpoint(path: str) -> dict:
    """Load a trainer checkpoint on the CPU; CheckpointError names the file on any problem."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except pickle.UnpicklingError as error:
        if "weights only" not in str(error).lower():
            raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({_first_line(error)})") from None
        # torch's own message advises turning weights_only off: wrong for a file that may not be ours.
        raise CheckpointError(f"checkpoint {path} holds Python objects a safe load refuses: "
                              f"{refused_globals(path, error)}; ddprun never loads a checkpoint that could "
                              f"run code, so use one written by ddprun train") from None
    except Exception as error:  # torch raises many types for truncated or foreign files
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({_first_line(error)})") from None
    check_contents(state, path=path)
    return state


def _first_line(error: Exception) -> str:
    """The first sentence of an error: torch follows it with paragraphs of advice."""
    text = str(error).strip()
    return text.splitlines()[0].split(". ")[0].rstrip(".") if text else type(error).__name__


def refused_globals(path: str, error: Exception) -> str:
    """The globals (module.name) in the pickle that weights_only does not allow, as one string."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # a file too damaged to scan: fall back on the name in torch's message
        names = re.findall(r"GLOBAL ([\w.]+)", str(error))
    return ", ".join(names) if names else "an object of unknown type"


# The type of every top-level entry, and of the `args` entries the trainer reads back.
_TOP_TYPES = {"format": int, "model": dict, "optimizer": dict, "scaler": (dict, type(None)), "schedule": dict,
              "epoch": int, "batch_in_epoch": int, "step": int, "world_size": int, "rng": list, "args": dict,
              "best_val_accuracy": (float, type(None))}
_ARGS_TYPES = {"model": str, "optimizer": str, "image_size": int}
_RNG_TYPES = {"torch": torch.Tensor, "python": torch.Tensor, "python_version": int,
              "python_gauss": (float, type(None))}
_TYPE_NAMES = {int: "an int", float: "a float", str: "a str", dict: "a dict", list: "a list",
               torch.Tensor: "a tensor", type(None): "None"}


def check_contents(state: Any, *, path: str) -> None:
    """CheckpointError naming the first key, type, length or value that a trainer checkpoint cannot have."""
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        missing = [key for key in REQUIRED_KEYS if key not in state] if isinstance(state, dict) else []
        detail = f"missing keys: {', '.join(missing)}" if missing else f"it holds {_type_name(state)}"
        raise CheckpointError(f"{path} is not a ddprun train checkpoint ({detail})")
    if state["format"] != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {state['format']}, expected {FORMAT_VERSION}")
    _check_types(state, _TOP_TYPES, where="", path=path)
    for name in ("epoch", "batch_in_epoch", "step"):
        if state[name] < 0:
            raise CheckpointError(f"checkpoint {path}: {name} is {state[name]}, it cannot be negative")
    _check_types(state["args"], _ARGS_TYPES, where="args.", path=path)
    _check_model_and_optimizer(state, path=path)
    _check_rng(state, path=path)


def _check_types(mapping: dict, types: dict, *, where: str, path: str) -> None:
    for key, expected in types.items():
        if key not in mapping:
            raise CheckpointError(f"checkpoint {path}: {where}{key} is missing")
        value = mapping[key]
        kinds = expected if isinstance(expected, tuple) else (expected,)
        if isinstance(value, bool) or not isinstance(value, kinds):  # a bool is an int to isinstance
            wanted = " or ".join(_TYPE_NAMES[kind] for kind in kinds)
            raise CheckpointError(f"checkpoint {path}: {where}{key} is {_type_name(value)}, expected {wanted}")


def _type_name(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def _check_model_and_optimizer(state: dict, *, path: str) -> None:
    for name, tensor in state["model"].items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"checkpoint {path}: model entry {name!r} is {_type_name(tensor)}, "
                                  f"expected a tensor")
    optimizer = state["optimizer"]
    if not isinstance(optimizer.get("state"), dict) or not isinstance(optimizer.get("param_groups"), list) \
            or not all(isinstance(group, dict) for group in optimizer["param_groups"]):
        raise CheckpointError(f"checkpoint {path}: optimizer is not an optimizer state "
                              f"(expected a dict with state and a list of param_groups)")
    schedule = state["schedule"]
    if isinstance(schedule.get("last_epoch"), bool) or not isinstance(schedule.get("last_epoch"), int):
        raise CheckpointError(f"checkpoint {path}: schedule is not an lr scheduler state (no last_epoch step)")


def _check_rng(state: dict, *, path: str) -> None:
    if len(state["rng"]) != state["world_size"]:
        raise CheckpointError(f"checkpoint {path}: rng holds {len(state['rng'])} states for world size "
                              f"{state['world_size']}")
    for rank, rng in enumerate(state["rng"]):
        if not isinstance(rng, dict):
            raise CheckpointError(f"checkpoint {path}: rng[{rank}] is {_type_name(rng)}, expected a dict")
        _check_types(rng, _RNG_TYPES, where=f"rng[{rank}].", path=path)


def capture_rng() -> dict:
    """This process's RNG states (torch, CUDA, Python, NumPy), as tensors and primitives."""
    version, internal, gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor(internal, dtype=torch.int64),
        "python_version": version,
        "python_gauss": gauss,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy_state = _numpy_state()
    if numpy_state is not None:
        state["numpy"] = numpy_state
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    internal = tuple(int(value) for value in state["python"].tolist())
    random.setstate((state["python_version"], internal, state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        _set_numpy_state(state["numpy"])


def _numpy_state() -> Optional[dict]:
    try:
        import numpy
    except ImportError:
        return None
    name, keys, position, has_gauss, gauss = numpy.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "position": int(position),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def _set_numpy_state(state: dict) -> None:
    import numpy

    keys = state["keys"].numpy().astype("uint32")
    numpy.random.set_state((state["name"], keys, state["position"], state["has_gauss"], state["gauss"]))
