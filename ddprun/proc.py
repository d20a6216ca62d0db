"""This process's children, through psutil.

Only the launch path imports this module, so the CLI's fast paths never load psutil. It is
imported here, not in the functions: deaths.py calls them from a SIGCHLD handler.
"""

from __future__ import annotations

import psutil


def children() -> list[int]:
    """Pids of this process's direct children, exited or not."""
    return [child.pid for child in psutil.Process().children()]


def zombie_children() -> list[int]:
    """Pids of this process's children that have exited and wait to be reaped."""
    zombies = []
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                zombies.append(child.pid)
        except psutil.NoSuchProcess:
            continue  # reaped meanwhile
    return zombies
