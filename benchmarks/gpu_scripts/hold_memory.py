"""Takes GiB of device memory (argv[2], on CUDA when there is one), writes its pid to DIR/rank<R>.pid (argv[1]), then waits.

The GPU check kills the launcher with SIGKILL while this waits, and watches the memory come back.
"""

import os
import sys
import time

import torch

out_dir, gib = sys.argv[1], float(sys.argv[2])
device = "cuda" if torch.cuda.is_available() else "cpu"
held = torch.ones(int(gib * (1 << 30)), dtype=torch.uint8, device=device)  # ones: pages really taken
if device == "cuda":
    torch.cuda.synchronize()
rank = os.environ.get("RANK", "0")
with open(os.path.join(out_dir, f"rank{rank}.tmp"), "w", encoding="utf-8") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(out_dir, f"rank{rank}.tmp"), os.path.join(out_dir, f"rank{rank}.pid"))
print(f"holding {gib:g} GiB on {device}", flush=True)
time.sleep(300)  # killed long before this ends
