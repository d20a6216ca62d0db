"""Speed of `ddprun train`'s worker: data overhead, CPU scaling, and (where present) one GPU.

    python benchmarks/bench_train.py            # full run, about 35 minutes on 2 CPU cores
    python benchmarks/bench_train.py --quick    # fewer repeats, for a smoke check

a) Data is never the bottleneck: in one process, the trainer's step over `--data synthetic`
   against the same DDP model's bare forward + backward + optimizer step on one fixed batch,
   alternated over several rounds (median). Beside it: the throughput of the classic
   tutorial's FakeData + ToTensor DataLoader on its own.
b) CPU scaling: 2 processes against 1, each with one thread, resnet18 on 32x32 images,
   synthetic data, the same per-process batch (32, then 64): `ddprun train` in each of
   --variants (default: the shared-memory all-reduce and gloo's), a plain DDP loop under
   torchrun and the same loop without DDP (processes that never communicate: the ceiling),
   interleaved, medians of the repeats. Beside the wall-clock ratio, a CPU-bound
   estimate (2 x CPU time per step at 1 process / at 2 processes), which other load on the
   machine disturbs much less.
c) With a GPU: resnet50, bf16, channels_last, synthetic data, images/s on 1 GPU, the trainer
   against a plain torchvision training loop.

The script is also the plain loop's worker (`--plain-worker`, `--plain-gpu-worker`), so the
comparison needs no other file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
DDPRUN_TRAIN = [sys.executable, "-m", "ddprun", "train", "--cpu"]
SCALING_ARGS = ["--model", "resnet18", "--image-size", "32", "--num-classes", "10"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--batch-size", type=int, default=32, help="per process, for (a)")
    parser.add_argument("--scaling-batch-sizes", type=lambda text: [int(v) for v in text.split(",")],
                        default=[32, 64], help="per-process batches compared in (b), e.g. 32,64")
    parser.add_argument("--variants", type=lambda text: text.split(","), default=["shm", "gloo"],
                        help="the trainer's variants compared in (b): " + ", ".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=None, help="runs per configuration in (b)")
    parser.add_argument("--skip", choices=["a", "b", "c"], action="append", default=[])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plain-gpu-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=30, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return env


# ---------------------------------------------------------------- (a) data overhead, in this process

def bench_data_overhead(*, batch_size: int, steps: int, rounds: int) -> dict:
    import torch
    import torch.nn.functional as F

    from ddprun.worker import train as trainer
    from ddprun.worker.data import Placement, build_data
    from ddprun.worker.progress import NullReporter
    from ddprun.train_options import TrainOptions

    cuda = torch.cuda.is_available()
    opts = TrainOptions(
        model="resnet50" if cuda else "resnet18", image_size=224 if cuda else 32, num_classes=1000 if cuda else 10,
        batch_size=batch_size * (4 if cuda else 1), dataset_size=batch_size * (4 if cuda else 1) * steps,
        amp="bf16" if cuda else "off", channels_last=cuda, workers=0,
    )
    env = trainer.DistEnv()
    device = trainer.pick_device(env)
    trainer.init_distributed(opts, env=env, device=device)
    try:
        data = build_data(opts, rank=0, world_size=1, placement=Placement(device=device, channels_last=cuda))
        c = trainer.build_components(opts, env=trainer.DistEnv(), data=data, device=device, reporter=NullReporter(),
                                     steps=trainer.plan_steps(opts, data=data, world_size=1))
        images, labels = next(data.train.batches(0))

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        def bare() -> None:
            for _ in range(steps):
                with c.autocast():
                    loss = F.cross_entropy(c.forward(images), labels)
                loss.backward()
                c.optimizer.step()
                c.optimizer.zero_grad(set_to_none=not c.grads_in_buckets)
            sync()

        def through_trainer() -> None:
            clock = trainer.StepClock(warmup=steps + 1, device=device)  # the clock never starts: no extra syncs
            trainer.run_epoch(c, trainer.Position(), opts=opts, total_steps=steps, clock=clock,
                              reporter=NullReporter(), after_step=lambda loss: None)
            sync()

        bare_times, trainer_times = [], []
        bare(), through_trainer()  # warm up both paths
        for _ in range(rounds):
            for run, times in ((bare, bare_times), (through_trainer, trainer_times)):
                began = time.perf_counter()
                run()
                times.append((time.perf_counter() - began) / steps)
    finally:
        torch.distributed.destroy_process_group()
    bare_step, trainer_step = statistics.median(bare_times), statistics.median(trainer_times)
    return {
        "model": f"{opts.model} {opts.image_size}x{opts.image_size} batch {opts.batch_size} on {device.type}",
        "bare_step_ms": bare_step * 1e3, "trainer_step_ms": trainer_step * 1e3,
        "overhead_pct": (trainer_step / bare_step - 1) * 100,
        "trainer_samples_per_sec": opts.batch_size / trainer_step,
    }


def bench_fakedata(*, batch_size: int, image_size: int, batches: int, workers: int) -> float:
    """Images/s of the tutorial's pipeline on its own: FakeData + ToTensor through a DataLoader."""
    import torchvision
    from torch.utils.data import DataLoader

    dataset = torchvision.datasets.FakeData(size=batch_size * batches, image_size=(3, image_size, image_size),
                                            num_classes=10, transform=torchvision.transforms.ToTensor())
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers)
    began = time.perf_counter()
    count = sum(len(labels) for _, labels in loader)
    return count / (time.perf_counter() - began)


# ---------------------------------------------------------------- (b) CPU scaling, in subprocesses

# The trainer's variants compared in (b): name -> extra `ddprun train` options.
VARIANTS = {
    "shm": ["--grad-allreduce", "shm"],  # what auto picks for CPU ranks on one host
    "gloo": ["--grad-allreduce", "backend"],  # DDP's own all-reduce through gloo
    "bf16": ["--grad-allreduce", "backend", "--grad-compression", "bf16"],
    "powersgd": ["--grad-allreduce", "backend", "--grad-compression", "powersgd"],
}


def ours(nproc: int, *, batch_size: int, steps: int, workdir: Path, variant: str) -> dict:
    metrics = workdir / f"ours-{nproc}-{time.monotonic_ns()}.json"
    size = nproc * batch_size * (steps + 5)  # the trainer's clock skips the first 5 steps
    command = DDPRUN_TRAIN + ["--nproc", str(nproc), *SCALING_ARGS, *VARIANTS[variant],
                              "--batch-size", str(batch_size), "--dataset-size", str(size), "--epochs", "1",
                              "--log-interval", "3600", "--metrics-json", str(metrics)]
    _run(command)
    metrics = json.loads(metrics.read_text())
    return {"samples_per_sec": metrics["samples_per_sec"], "cpu_seconds_per_step": metrics["cpu_seconds_per_step"]}


def plain(nproc: int, *, batch_size: int, steps: int, workdir: Path, alone: bool = False) -> dict:
    out = workdir / f"plain-{nproc}-{time.monotonic_ns()}.json"
    command = TORCHRUN + ["--nproc-per-node", str(nproc), __file__, "--plain-worker", "--batch-size",
                          str(batch_size), "--steps", str(steps), "--out", str(out)] + ["--alone"] * alone
    _run(command)
    return json.loads(out.read_text())


def _run(command: list[str]) -> None:
    result = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        sys.exit(f"benchmark run failed ({result.returncode}): {' '.join(command)}\n{result.stderr[-3000:]}")


def bench_scaling(*, batch_size: int, steps: int, repeats: int, variants: list[str]) -> dict:
    kinds = [f"ours_{name}" for name in variants] + ["plain", "alone"]
    runs = {(kind, n): [] for kind in kinds for n in (1, 2)}
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(repeats):  # interleaved, so a noisy minute hits every configuration alike
            for (kind, nproc), measured in runs.items():
                common = dict(batch_size=batch_size, steps=steps, workdir=Path(workdir))
                if kind in ("plain", "alone"):
                    measured.append(plain(nproc, alone=kind == "alone", **common))
                else:
                    measured.append(ours(nproc, variant=kind.removeprefix("ours_"), **common))
    result = {"batch_size": batch_size, "kinds": kinds, "repeats": repeats, "load_average": os.getloadavg()}
    for (kind, n), measured in runs.items():
        result[f"{kind}_{n}proc_samples_per_sec"] = statistics.median(m["samples_per_sec"] for m in measured)
        result[f"{kind}_{n}proc_cpu_ms_per_step"] = 1e3 * statistics.median(m["cpu_seconds_per_step"] for m in measured)
    for kind in kinds:
        pairs = list(zip(runs[(kind, 1)], runs[(kind, 2)]))
        ratios = [two["samples_per_sec"] / one["samples_per_sec"] for one, two in pairs]
        result[f"{kind}_ratio"] = statistics.median(ratios)
        result[f"{kind}_ratios"] = ratios
        # What the ratio would be if each process had its core to itself and never waited: CPU cost of
        # a step at 1 process against 2. Other load on the machine disturbs it far less than wall time.
        cpu = [2 * one["cpu_seconds_per_step"] / two["cpu_seconds_per_step"] for one, two in pairs]
        result[f"{kind}_cpu_bound_ratio"] = statistics.median(cpu)
    return result


def plain_worker(args: argparse.Namespace) -> None:
    """A plain DDP loop, as people write it: default DDP, SGD, one fixed random batch. With --alone, no DDP:
    each process trains on its own and never communicates, the machine's ceiling for any all-reduce."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import torchvision
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    if not args.alone:
        model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images, labels = torch.randn(args.batch_size, 3, 32, 32), torch.randint(0, 10, (args.batch_size,))
    warmup = 5
    for step in range(warmup + args.steps):
        if step == warmup:
            began, cpu_began = time.perf_counter(), time.process_time()
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu_began
    if dist.get_rank() == 0:
        speed = dist.get_world_size() * args.batch_size * args.steps / seconds
        args.out.write_text(json.dumps({"samples_per_sec": speed, "cpu_seconds_per_step": cpu / args.steps}))
    dist.destroy_process_group()


# ---------------------------------------------------------------- (c) one GPU

def bench_gpu(*, steps: int) -> dict:
    batch = 128
    with tempfile.TemporaryDirectory() as workdir:
        metrics = Path(workdir) / "ours.json"
        _run([sys.executable, "-m", "ddprun.worker.train", "--model", "resnet50", "--amp", "bf16", "--channels-last",
              "--batch-size", str(batch), "--dataset-size", str(batch * (steps + 5)), "--log-interval", "3600",
              "--metrics-json", str(metrics)])
        out = Path(workdir) / "plain.json"
        _run([sys.executable, __file__, "--plain-gpu-worker", "--batch-size", str(batch), "--steps", str(steps),
              "--out", str(out)])
        return {"ours_images_per_sec": json.loads(metrics.read_text())["samples_per_sec"],
                "plain_images_per_sec": json.loads(out.read_text())["samples_per_sec"], "batch": batch}


def plain_gpu_worker(args: argparse.Namespace) -> None:
    """A plain single-GPU torchvision loop with the same levers: bf16 autocast, channels_last."""
    import torch
    import torch.nn.functional as F
    import torchvision

    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    images = torch.randn(args.batch_size, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.batch_size,), device="cuda")
    warmup = 5
    for step in range(warmup + args.steps):
        if step == warmup:
            torch.cuda.synchronize()
            began = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()
    args.out.write_text(json.dumps({"samples_per_sec": args.batch_size * args.steps / (time.perf_counter() - began)}))


# ---------------------------------------------------------------- report

def report(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="ddprun train benchmarks (medians)")
    for column in ("measure", "ddprun train", "reference", "figure"):
        table.add_column(column, justify="left" if column == "measure" else "right")
    if "data" in results:
        a = results["data"]
        table.add_row(f"(a) step time, {a['model']}", f"{a['trainer_step_ms']:.1f} ms",
                      f"{a['bare_step_ms']:.1f} ms (bare step)", f"{a['overhead_pct']:+.1f}%")
        for workers, speed in a["fakedata_images_per_sec"].items():
            table.add_row(f"(a) FakeData+ToTensor DataLoader, {workers} workers", "", "",
                          f"{speed:,.0f} images/s")
        table.add_row("(a) trainer, synthetic data", "", "", f"{a['trainer_samples_per_sec']:,.0f} samples/s")
    for b in results.get("scaling", []):
        batch = b["batch_size"]
        for kind in b["kinds"]:
            if kind in ("plain", "alone"):
                continue
            label = f"(b) batch {batch}/process, {' '.join(VARIANTS[kind.removeprefix('ours_')])}"
            table.add_row(f"{label}: 1 -> 2 processes", f"{b[kind + '_1proc_samples_per_sec']:,.0f} -> "
                          f"{b[kind + '_2proc_samples_per_sec']:,.0f}/s", f"{b['plain_1proc_samples_per_sec']:,.0f} -> "
                          f"{b['plain_2proc_samples_per_sec']:,.0f}/s (plain DDP)", "")
            table.add_row(f"{label}: scaling 2 vs 1 process", f"{b[kind + '_ratio']:.2f}x",
                          f"{b['plain_ratio']:.2f}x (plain DDP)", "target >= 1.7x")
            table.add_row(f"{label}: CPU ms per step, 1 -> 2 processes",
                          f"{b[kind + '_1proc_cpu_ms_per_step']:.0f} -> {b[kind + '_2proc_cpu_ms_per_step']:.0f}",
                          f"{b['plain_1proc_cpu_ms_per_step']:.0f} -> {b['plain_2proc_cpu_ms_per_step']:.0f}", "")
            table.add_row(f"{label}: scaling if CPU-bound (2 x cpu1/cpu2)", f"{b[kind + '_cpu_bound_ratio']:.2f}x",
                          f"{b['plain_cpu_bound_ratio']:.2f}x", "noise-robust cross-check")
        if "alone_ratio" in b:
            table.add_row(f"(b) batch {batch}: 2 processes that never communicate (no DDP)", "",
                          f"{b['alone_1proc_samples_per_sec']:,.0f} -> {b['alone_2proc_samples_per_sec']:,.0f}/s",
                          f"{b['alone_ratio']:.2f}x: the ceiling")
        table.add_row(f"(b) batch {batch}: load average after the runs", "",
                      "", " / ".join(f"{v:.2f}" for v in b["load_average"]))
    if "gpu" in results:
        c = results["gpu"]
        table.add_row(f"(c) resnet50 bf16 channels_last, 1 GPU, batch {c['batch']}",
                      f"{c['ours_images_per_sec']:,.0f}/s", f"{c['plain_images_per_sec']:,.0f}/s (plain loop)", "")
    Console(width=130).print(table)


def main() -> None:
    args = parse_args()
    if args.plain_worker:
        return plain_worker(args)
    if args.plain_gpu_worker:
        return plain_gpu_worker(args)
    os.environ.update(OMP_NUM_THREADS="1")  # (a) runs here, one thread like each process in (b)
    import torch

    torch.set_num_threads(1)
    steps = 10 if args.quick else 20
    repeats = args.repeats or (1 if args.quick else 5)
    results: dict = {}
    if "a" not in args.skip:
        results["data"] = bench_data_overhead(batch_size=args.batch_size, steps=steps, rounds=3 if args.quick else 5)
        results["data"]["fakedata_images_per_sec"] = {
            workers: bench_fakedata(batch_size=args.batch_size, image_size=32, batches=steps, workers=workers)
            for workers in (0, 2)
        }
    if "b" not in args.skip:
        # More steps in (b): the trainer skips 5 in its clock, and PowerSGD compresses from step 10 on.
        results["scaling"] = [bench_scaling(batch_size=batch, steps=steps + 10, repeats=repeats,
                                            variants=args.variants)
                              for batch in args.scaling_batch_sizes]
    if "c" not in args.skip and torch.cuda.is_available():
        results["gpu"] = bench_gpu(steps=steps)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
