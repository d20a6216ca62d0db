"""What a rank sees at start, written as JSON to $OUT_DIR/rank<R>.json: under warm start it must be
what a fresh `python script.py` would see. MODE=spawn|fork also runs a multiprocessing child."""

import json
import multiprocessing
import os
import random
import signal
import sys

preloaded = "torch" in sys.modules  # before this script imports it: the fork server's import


def square(x):
    return x * x


def parent_cmdline():
    with open(f"/proc/{os.getppid()}/cmdline") as f:
        return f.read().replace("\0", " ")


def dispositions():
    names = ("SIGINT", "SIGTERM", "SIGPIPE", "SIGUSR1", "SIGHUP", "SIGCHLD", "SIGXFSZ")
    return {name: repr(signal.getsignal(getattr(signal, name))) for name in names}


if __name__ == "__main__":
    import torch

    rank = os.environ["RANK"]
    mode = os.environ.get("MODE", "")
    children = []
    if mode:
        with multiprocessing.get_context(mode).Pool(1) as pool:
            children = pool.map(square, [int(rank) + 2])
    out = {
        "argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(),
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "OMP_NUM_THREADS", "USER_MARK", "DDPRUN_WARM_SOCKET")},
        "threads": torch.get_num_threads(), "signals": dispositions(),
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "preloaded": preloaded, "parent": parent_cmdline(), "pid": os.getpid(), "random": random.random(),
        "children": children, "stdin_tty": os.isatty(0),
    }
    os.makedirs(os.environ["OUT_DIR"], exist_ok=True)
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    print("hello from", rank)
