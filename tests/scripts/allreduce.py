import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(t)
out = os.environ.get("OUT_DIR", "/tmp/t/out"); os.makedirs(out, exist_ok=True)
open(f"{out}/rank{dist.get_rank()}.txt", "w").write(f"{t.item()} {dist.get_world_size()} {sys.argv[1:]}\n")
print("rank", dist.get_rank(), "sum", t.item(), "args", sys.argv[1:])
dist.destroy_process_group()
