"""Functions that tests/test_api.py runs on the ranks through ddprun.launch (pickled by reference:
the ranks import this module through the caller's sys.path)."""

from __future__ import annotations

import os
import signal
import time


def all_reduce(scale: float) -> tuple[int, float, int]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    world = dist.get_world_size()
    dist.destroy_process_group()
    return int(os.environ["RANK"]), value.item() * scale, world


def fail_on_rank_1() -> str:
    if os.environ["RANK"] == "1":
        print("about to fail", flush=True)
        raise ValueError("rank one cannot go on")
    return "ok"


def sleep_forever(folder: str, *, stubborn: bool) -> None:
    """Write this rank's pid, then wait; `stubborn` ignores the graceful stop (SIGINT, SIGTERM)."""
    if stubborn:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.path.join(folder, f"pid_{os.environ['RANK']}"), "w") as out:
        out.write(str(os.getpid()))
    while True:
        time.sleep(0.1)
