"""A 2-rank job that holds its rendezvous open until $OUT_DIR/go exists (at most 60 s)."""
import os, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
out = os.environ["OUT_DIR"]
os.makedirs(out, exist_ok=True)
open(f"{out}/ready{dist.get_rank()}", "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(f"{out}/go") and time.monotonic() < deadline:
    time.sleep(0.2)
time.sleep(2)  # the agents poll the rendezvous state meanwhile: any injected pickle is read now
t = torch.ones(1)
dist.all_reduce(t)
print("sum", t.item(), flush=True)
dist.destroy_process_group()
