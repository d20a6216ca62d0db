"""Checkpoints that survive kill -9 and load with `weights_only=True`.

`save_atomic` writes a temp file in the same directory, flushes and fsyncs it,
renames it over the target with `os.replace` and fsyncs the directory, so the
target is always either the previous complete checkpoint or the new one.
Everything stored is tensors, plain containers and primitives, so `torch.load`
never needs to unpickle arbitrary objects.
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import tempfile
from typing import Any, Optional

import torch

FORMAT_VERSION = 1
REQUIRED_KEYS = ("format", "model", "optimizer", "epoch", "batch_in_epoch", "step", "rng", "args")


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
    except Exception as error:  # torch raises many types for truncated or foreign files
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({reason})") from None
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        raise CheckpointError(f"{path} is not a ddprun train checkpoint (missing keys)")
    if state["format"] != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {state['format']}, expected {FORMAT_VERSION}")
    return state


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
