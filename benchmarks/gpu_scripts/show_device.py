"""Records what a rank sees: its CUDA device's UUID and CUDA_VISIBLE_DEVICES (JSON, to argv[1] and stdout)."""

import json
import os
import sys

import torch


def device_uuid():
    if not torch.cuda.is_available():
        return None
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid


record = {
    "rank": int(os.environ.get("RANK", "0")),
    "uuid": device_uuid(),
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
    "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
}
print(json.dumps(record), flush=True)
with open(sys.argv[1], "w", encoding="utf-8") as f:
    json.dump(record, f)
