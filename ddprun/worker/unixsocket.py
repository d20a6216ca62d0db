"""A Unix socket's address for a path of any length: the warm-start server's, in the job folder.

sun_path holds 107 bytes, and a job folder under a deep --log-dir or TMPDIR is longer. Through a
descriptor of the socket's folder, /proc/self/fd/N/NAME names the same file in a few bytes.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

_SUN_PATH_MAX = 100


@contextlib.contextmanager
def address(path: str) -> Iterator[str]:
    """`path` itself where it fits, else /proc/self/fd/N/NAME while N (the folder) is open."""
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        yield path
        return
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{folder}/{os.path.basename(path)}"
    finally:
        os.close(folder)
