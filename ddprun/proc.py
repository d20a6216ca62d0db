"""This process's children, read from /proc (Linux)."""

from __future__ import annotations

import os


def children(parent: int | None = None) -> list[tuple[int, str]]:
    """(pid, state letter) of each direct child of `parent` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.append((int(entry), fields[0]))
    return found
