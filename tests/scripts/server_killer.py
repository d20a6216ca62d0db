"""Attempt 0: rank 1 kills its parent (under warm start, the fork server), or itself with
MODE=self. Attempt 1: every rank succeeds. Each rank records "<parent pid> <its command line>"."""

import os
import signal
import time

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = os.environ["RANK"]
with open(f"/proc/{os.getppid()}/cmdline") as f:
    parent = f.read().replace("\0", " ")
os.makedirs(os.environ["OUT_DIR"], exist_ok=True)
with open(os.path.join(os.environ["OUT_DIR"], f"parent{rank}.{attempt}"), "w") as f:
    f.write(f"{os.getppid()} {parent}")
if attempt == 0:
    if rank == "1":
        os.kill(os.getpid() if os.environ.get("MODE") == "self" else os.getppid(), signal.SIGKILL)
    time.sleep(60)
