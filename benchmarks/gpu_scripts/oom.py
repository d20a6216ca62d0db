"""A rank that runs out of GPU memory: one allocation of 4 TiB, far past any GPU's memory."""

import torch

device = "cuda" if torch.cuda.is_available() else "cpu"
too_much = torch.empty(1 << 42, dtype=torch.uint8, device=device)
