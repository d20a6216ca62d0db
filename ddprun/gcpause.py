"""Importing torch with Python's garbage collector paused.

`import torch` (and torchvision) builds a few hundred thousand long-lived objects and almost no
garbage, yet each one it builds counts towards gc's next pass, and those passes walk everything
built so far: 0.2 s of torch's 1.2 s import on the reference machine, 0.4 s of torch and
torchvision's 2.2 s (measured). Paused, then frozen: later passes never walk those objects
again, and a process forked afterwards (the warm-start server's ranks) never writes to their
pages for gc's sake, so they stay shared.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
