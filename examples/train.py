"""The classic PyTorch DDP tutorial (DDP + DistributedSampler + FakeData), written correctly.

Run it with either launcher; the script itself never picks GPUs or sets CUDA_VISIBLE_DEVICES:

    ddprun run examples/train.py -- --epochs 2
    torchrun --nproc-per-node 2 examples/train.py --epochs 2
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def setup() -> tuple[int, torch.device]:
    """Join the process group; the launcher's LOCAL_RANK picks this process's GPU."""
    if "LOCAL_RANK" not in os.environ:
        sys.exit("start me with a launcher: `ddprun run examples/train.py` or `torchrun examples/train.py`")
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        torch.cuda.set_device(local_rank)  # before init, so NCCL binds this GPU
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return local_rank, device


def cleanup() -> None:
    dist.destroy_process_group()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=256, help="FakeData images per epoch")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    local_rank, device = setup()
    try:
        train(args, local_rank=local_rank, device=device)
    finally:
        cleanup()  # also after an exception, so no rank is left waiting


def train(args: argparse.Namespace, *, local_rank: int, device: torch.device) -> None:
    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    dataset = torchvision.datasets.FakeData(
        size=args.samples, image_size=(3, args.image_size, args.image_size), num_classes=10,
        transform=torchvision.transforms.ToTensor(),
    )
    sampler = DistributedSampler(dataset, shuffle=True)  # each rank gets its own shard
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=device.type == "cuda", drop_last=True)
    model = torchvision.models.resnet18(num_classes=10).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        total = torch.zeros(2, device=device)
        for images, labels in loader:
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total[0] += loss.detach() * len(labels)
            total[1] += len(labels)
        dist.all_reduce(total)  # the loss over every rank's samples, not rank 0's alone
        if dist.get_rank() == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {total[0].item() / total[1].item():.4f} "
                  f"over {int(total[1].item())} samples", flush=True)


if __name__ == "__main__":
    main()
