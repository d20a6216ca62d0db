"""The baseline for `ddprun train`: a plain torchvision training loop, one process, no DDP.

Same model, optimizer (SGD, lr 0.1, momentum 0.9), synthetic data (a fixed pool of 256 images
on the device, batches gathered by index), AMP and memory format as the bundled trainer; the
first --warmup steps are not timed, as in the trainer. Writes {"samples_per_sec": ...} to --out.
"""

import argparse
import contextlib
import json
import time

import torch
import torch.nn.functional as F
import torchvision

POOL = 256


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=100, help="steps in all, warm-up included")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--amp", choices=("off", "bf16", "fp16"), default="bf16")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    memory_format = torch.channels_last if args.channels_last else torch.preserve_format
    model = torchvision.models.get_model(args.model, weights=None, num_classes=1000).to(device, memory_format=memory_format)
    forward = torch.compile(model) if args.compile else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
    images = torch.randn(POOL, 3, args.image_size, args.image_size, device=device).contiguous(memory_format=memory_format)
    labels = torch.randint(0, 1000, (POOL,), device=device)
    order = torch.randint(0, POOL, (args.steps, args.batch_size), device=device)
    started = None
    for step in range(args.steps):
        if step == args.warmup:
            sync(device)
            started = time.perf_counter()
        x, y = images.index_select(0, order[step]), labels.index_select(0, order[step])
        autocast = torch.autocast(device_type=device.type, dtype=dtype) if dtype else contextlib.nullcontext()
        with autocast:
            loss = F.cross_entropy(forward(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
    sync(device)
    measured = args.steps - args.warmup
    speed = measured * args.batch_size / (time.perf_counter() - started) if started and measured > 0 else None
    result = {"samples_per_sec": speed, "steps": args.steps, "measured_steps": measured, "device": device.type,
              "model": args.model, "batch_size": args.batch_size, "amp": args.amp,
              "channels_last": args.channels_last, "compile": args.compile}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
