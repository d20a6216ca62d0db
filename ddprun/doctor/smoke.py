"""The doctor's live test, run in every rank: process group, collectives, bandwidth sweep.

    python -m ddprun.doctor.smoke --out FILE --max-bytes N --progress-dir DIR

Launched by `ddprun doctor` through `ddprun run`. Each rank records the step it is about to
run in DIR/rank<R> so that the doctor can name the step that hung. Rank 0 (re)writes the
results to FILE after every step, so a hang still leaves the steps that passed; another rank
writes FILE.rank<R> only once it fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ddprun.doctor.checks import EXIT_STEP, FAIL, OK, SKIP, format_progress, human_bytes, rank_report_path

CHECK_ELEMENTS = 1031  # odd, so no collective algorithm gets an even split for free
DTYPES = ("float32", "float64", "int32", "int64", "float16", "bfloat16")
HALF_DTYPES = ("float16", "bfloat16")


class Smoke:
    """One rank's run: the steps so far, and where they are written."""

    def __init__(self, *, args: argparse.Namespace, rank: int, local_rank: int, world: int):
        self.args, self.rank, self.local_rank, self.world = args, rank, local_rank, world
        self.backend = args.backend or ("nccl" if local_rank < _cuda_devices() else "gloo")
        self.device = torch.device("cpu")  # set by run(), once the backend's device is known
        self.steps: list[dict] = []
        self.bandwidth: list[dict] = []
        self.step = "start"
        self._index = 0

    def mark(self, step: str) -> None:
        """Record the step this rank is about to run (atomically: the doctor may read at any time)."""
        self._index += 1
        self.step = step
        path = os.path.join(self.args.progress_dir, f"rank{self.rank}")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(format_progress(pid=os.getpid(), index=self._index, step=step))
        os.replace(path + ".tmp", path)

    def record(self, name: str, status: str, detail: str) -> None:
        self.steps.append({"name": name, "status": status, "detail": detail})
        self.write()

    def write(self) -> None:
        """Rank 0 writes FILE. Another rank writes FILE.rank<R> once it has a failure: the launcher
        stops every rank as soon as one fails, so rank 0 may be gone before it can report it."""
        if self.rank == 0:
            self._dump(self.args.out)
        elif any(step["status"] == FAIL for step in self.steps):
            self._dump(rank_report_path(self.args.out, self.rank))

    def _dump(self, path: str) -> None:
        report = {
            "backend": self.backend,
            "world_size": self.world,
            "device": describe_device(self.device),
            "steps": self.steps,
            "bandwidth": self.bandwidth,
        }
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} per rank"
    return "CPU"


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pick_device(*, backend: str, local_rank: int) -> torch.device:
    """nccl: the GPU at LOCAL_RANK (one per rank); gloo: the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    count = _cuda_devices()
    if local_rank >= count:
        raise RuntimeError(f"nccl needs one GPU per rank: LOCAL_RANK={local_rank}, but torch sees {count} GPU(s)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


# ---------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------


def check_all_reduce(smoke: Smoke, dtype_name: str) -> tuple[str, str]:
    dtype = getattr(torch, dtype_name)
    pattern = torch.arange(CHECK_ELEMENTS, device=smoke.device) % 7 + 1
    tensor = (pattern * (smoke.rank + 1)).to(dtype)
    try:
        dist.all_reduce(tensor)
    except (RuntimeError, TypeError, ValueError) as error:
        if "unsupported" in str(error).lower() or "not supported" in str(error).lower():
            return SKIP, f"{smoke.backend} does not support {dtype_name}: {_first_line(error)}"
        raise
    expected = (pattern * (smoke.world * (smoke.world + 1) // 2)).to(torch.float64)
    got = tensor.to(torch.float64)
    tolerance = 1e-2 if dtype_name in HALF_DTYPES else 0.0
    wrong = ~torch.isclose(got, expected, rtol=tolerance, atol=0.0)
    example = _first_diff(got, expected, wrong) if bool(wrong.any()) else ""
    total = _total_over_ranks(smoke, int(wrong.sum()))  # rank 0 reports for every rank
    if total == 0:
        how = "within 1%" if tolerance else "exact"
        return OK, f"sum over {smoke.world} ranks of {CHECK_ELEMENTS} values is {how}"
    where = f"; here {example}" if example else " on other ranks"
    return FAIL, f"{total} wrong values after all_reduce, counted over all ranks{where}"


def check_broadcast(smoke: Smoke) -> tuple[str, str]:
    expected = torch.arange(CHECK_ELEMENTS, dtype=torch.int64, device=smoke.device) * 3 + 11
    tensor = expected.clone() if smoke.rank == 0 else torch.zeros_like(expected)
    dist.broadcast(tensor, src=0)
    failed = _total_over_ranks(smoke, 0 if torch.equal(tensor, expected) else 1)
    if failed == 0:
        return OK, f"every rank received rank 0's {CHECK_ELEMENTS} values"
    return FAIL, f"{failed} rank(s) received wrong values from rank 0"


def check_barrier(smoke: Smoke) -> tuple[str, str]:
    start = time.perf_counter()
    _barrier(smoke)
    return OK, f"all {smoke.world} ranks passed in {(time.perf_counter() - start) * 1e3:.1f} ms"


def _total_over_ranks(smoke: Smoke, count: int) -> int:
    total = torch.tensor([count], dtype=torch.int64, device=smoke.device)
    dist.all_reduce(total)
    return int(total.item())


def _first_diff(got: torch.Tensor, expected: torch.Tensor, wrong: torch.Tensor) -> str:
    index = int(wrong.nonzero()[0])
    return f"[{index}] = {got[index].item():g}, expected {expected[index].item():g}"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


# ---------------------------------------------------------------------------------------
# Bandwidth sweep
# ---------------------------------------------------------------------------------------


def iterations(size: int, *, gpu: bool) -> tuple[int, int]:
    """(warm-up, timed) iterations for one message size: fewer at large sizes to bound the run."""
    traffic = (8 << 30) if gpu else (256 << 20)  # bytes moved per size, roughly
    timed = max(2, min(50, traffic // size))
    return (3 if size < (1 << 20) else 1), timed


def bus_bandwidth(algbw: float, world: int) -> float:
    """nccl-tests' busbw for all-reduce: algbw * 2(n-1)/n, comparable across rank counts."""
    return algbw * 2 * (world - 1) / world


def sweep(smoke: Smoke) -> None:
    """All-reduce from 8 bytes doubling to --max-bytes; stops early past --sweep-budget seconds."""
    start = time.perf_counter()
    size = 8
    while size <= smoke.args.max_bytes:
        smoke.mark(f"bandwidth {human_bytes(size)}")
        per_op_s, elapsed_s = _measure(smoke, size=size, start=start)
        algbw = size / per_op_s / 1e9
        smoke.bandwidth.append(
            {
                "bytes": size,
                "time_us": round(per_op_s * 1e6, 2),
                "algbw_gbps": round(algbw, 6),
                "busbw_gbps": round(bus_bandwidth(algbw, smoke.world), 6),
            }
        )
        smoke.write()
        if elapsed_s > smoke.args.sweep_budget:  # elapsed is the max over ranks: every rank stops together
            break
        size *= 2


def _measure(smoke: Smoke, *, size: int, start: float) -> tuple[float, float]:
    buffer = torch.zeros(size // 4, dtype=torch.float32, device=smoke.device)  # zeros never overflow
    warmup, timed = iterations(size, gpu=smoke.device.type == "cuda")
    for _ in range(warmup):
        dist.all_reduce(buffer)
    smoke.synchronize()
    _barrier(smoke)
    began = time.perf_counter()
    for _ in range(timed):
        dist.all_reduce(buffer)
    smoke.synchronize()
    per_op = (time.perf_counter() - began) / timed
    stats = torch.tensor([per_op, time.perf_counter() - start], dtype=torch.float64, device=smoke.device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return float(stats[0]), float(stats[1])


def _barrier(smoke: Smoke) -> None:
    if smoke.backend == "nccl":
        dist.barrier(device_ids=[smoke.device.index])
    else:
        dist.barrier()


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ddprun.doctor.smoke", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="where rank 0 writes the results (JSON)")
    parser.add_argument("--progress-dir", required=True, help="where each rank records its current step")
    parser.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl where this rank has a GPU")
    parser.add_argument("--max-bytes", type=int, help="largest all-reduce (default 64 MiB CPU, 1 GiB GPU)")
    parser.add_argument("--timeout", type=float, default=60.0, help="process-group timeout, seconds")
    parser.add_argument("--sweep-budget", type=float, default=20.0, help="stop the sweep after this many seconds")
    return parser.parse_args(argv)


def correctness_steps(smoke: Smoke) -> list[tuple[str, Callable[[], tuple[str, str]]]]:
    steps = [(f"all_reduce {name}", (lambda name=name: check_all_reduce(smoke, name))) for name in DTYPES]
    return steps + [("broadcast", lambda: check_broadcast(smoke)), ("barrier", lambda: check_barrier(smoke))]


def run(smoke: Smoke) -> None:
    smoke.mark("init_process_group")
    smoke.device = pick_device(backend=smoke.backend, local_rank=smoke.local_rank)
    if smoke.args.max_bytes is None:
        smoke.args.max_bytes = (1 << 30) if smoke.device.type == "cuda" else (64 << 20)
    options = {"device_id": smoke.device} if smoke.backend == "nccl" else {}
    dist.init_process_group(smoke.backend, timeout=timedelta(seconds=smoke.args.timeout), **options)
    smoke.record("init_process_group", OK, f"{smoke.backend}, {smoke.world} ranks, {describe_device(smoke.device)}")
    for name, step in correctness_steps(smoke):
        smoke.mark(name)
        status, detail = step()
        smoke.record(name, status, detail)
    sweep(smoke)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        usage = "ddprun run --nproc 2 --cpu -m ddprun.doctor.smoke -- --out FILE --progress-dir DIR"
        print(f"ddprun.doctor.smoke runs under a launcher: {usage}", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    smoke = Smoke(args=args, rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", "0")), world=world)
    code = 0
    try:
        run(smoke)
        code = 1 if any(step["status"] == FAIL for step in smoke.steps) else 0
    except Exception as error:  # reported as this step's failure; the launcher shows the rank's output
        smoke.record(smoke.step, FAIL, f"{type(error).__name__}: {_first_line(error)}")
        print(f"ddprun doctor smoke: rank {rank} failed in {smoke.step}: {error}", file=sys.stderr)
        code = 1
    finally:
        if dist.is_initialized():
            smoke.mark("destroy_process_group")
            dist.destroy_process_group()
            smoke.record("destroy_process_group", OK, "clean shutdown")
        smoke.mark(EXIT_STEP)  # all done: a timeout from here on is the exit, not a collective
    return code


if __name__ == "__main__":
    sys.exit(main())
