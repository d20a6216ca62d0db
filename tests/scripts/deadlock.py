"""Rank 1 sleeps instead of calling all_reduce; rank 0 waits in it. Optional argv[1]: the process
group's timeout in seconds (default: gloo's 30 minutes). Each rank writes $OUT_DIR/ready<rank>
just before it blocks; a SIGUSR1 handler of the script's own writes $OUT_DIR/usr1_<rank>."""
import os, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist

timeout = timedelta(seconds=float(sys.argv[1])) if len(sys.argv) > 1 else None
dist.init_process_group("gloo", **({"timeout": timeout} if timeout else {}))
rank = dist.get_rank()
out = os.environ["OUT_DIR"]
os.makedirs(out, exist_ok=True)
signal.signal(signal.SIGUSR1, lambda *_: open(os.path.join(out, f"usr1_{rank}"), "w").close())
print(f"rank {rank} ready", flush=True)
open(os.path.join(out, f"ready{rank}"), "w").close()
if rank == 1:
    time.sleep(3600)  # the bug: rank 1 never reaches the all_reduce
t = torch.ones(1)
dist.all_reduce(t)
