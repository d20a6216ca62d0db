"""A worker whose behaviour the test picks with MODE; it writes its pid once the group is up."""
import ctypes
import os
import signal
import sys
import time

import torch.distributed as dist

mode = os.environ.get("MODE", "ok")
dist.init_process_group("gloo")
rank = dist.get_rank()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
out = os.environ["OUT_DIR"]
os.makedirs(out, exist_ok=True)
with open(f"{out}/pid{rank}.{restart}", "w") as f:
    f.write(str(os.getpid()))
print(f"stdout line from rank {rank}", flush=True)
print(f"stderr line from rank {rank}", file=sys.stderr, flush=True)


def load_batch(step):
    if step == 3:
        raise ValueError(f"corrupt sample in batch {step}")


if mode == "preempt":  # a scheduler's notice: save and leave
    got = []
    signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    open(f"{out}/preempted{rank}", "w").close()
elif mode == "sleep":
    time.sleep(300)
elif mode == "stubborn":  # ignores the polite signals: only SIGKILL ends it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(300)
elif rank == 1 and mode == "raise":
    load_batch(3)
elif mode == "raise_all":
    load_batch(3)
elif rank == 1 and mode == "exit3":
    sys.exit(3)
elif rank == 1 and mode == "exit7":
    os._exit(7)
elif rank == 1 and mode == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
elif rank == 1 and mode == "segv":
    ctypes.string_at(0)
elif rank == 1 and mode == "die_once" and restart == 0:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
dist.destroy_process_group()
