"""ddprun's bundled DDP trainer: `python -m ddprun.worker.train [options]`, started in every rank.

torch elastic sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT and
TORCHELASTIC_RESTART_COUNT. Without them the trainer runs as a single process.
Exit codes: 0 done, 2 bad input (options, checkpoint), 1 or an exception otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import resource
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddprun import torch_internals
from ddprun.errors import UsageError
from ddprun.worker.checkpoint import (
    CheckpointError, FORMAT_VERSION, capture_rng, load_checkpoint, remove_stale_temps, restore_rng, save_atomic,
)
from ddprun.worker.data import Batch, Placement, TrainData, build_data
from ddprun.worker.models import build_model
from ddprun.worker.progress import NullReporter, Reporter, RunSummary, write_metrics
from ddprun.worker import schedule
from ddprun.worker.shm_allreduce import SharedMemoryUnavailable, ShmAllreduce, capacity_for, shm_allreduce_hook
from ddprun.train_options import TrainOptions, check_warmup_steps, from_argv, validate

T = TypeVar("T")

# Checkpoint args that must match for the saved weights and optimizer state to fit.
_SHAPE_ARGS = ("model", "optimizer", "image_size")


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    restart_count: int = 0
    launched: bool = False  # started by torch elastic (env:// rendezvous) rather than by hand

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> "DistEnv":
        if "WORLD_SIZE" not in env:
            return cls()
        return cls(
            rank=int(env["RANK"]), local_rank=int(env.get("LOCAL_RANK", "0")), world_size=int(env["WORLD_SIZE"]),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")), launched=True,
        )


@dataclass
class Position:
    """Where training stands; what a checkpoint restores."""

    epoch: int = 0  # the epoch in progress (== epochs completed when batch_in_epoch is 0)
    batch_in_epoch: int = 0  # micro-batches of `epoch` already trained
    step: int = 0  # optimizer steps in total


@dataclass
class Components:
    raw: nn.Module  # unwrapped: state_dict without "module.", evaluation without collectives
    ddp: DDP
    forward: Callable  # ddp, or torch.compile(ddp)
    optimizer: torch.optim.Optimizer
    scaler: Optional[torch.amp.GradScaler]
    amp_dtype: Optional[torch.dtype]
    device: torch.device
    data: TrainData
    grads_in_buckets: bool  # .grad tensors are views into DDP's buckets: zero them in place, never drop them
    grad_allreduce: str  # "shm", or the backend that all-reduces the gradients
    scheduler: torch.optim.lr_scheduler.LRScheduler
    label_smoothing: float
    clip_grad_norm: Optional[float]

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)


def main(argv: Optional[Sequence[str]] = None) -> int:
    began = time.perf_counter()
    # torch elastic stops workers with SIGTERM: unwind through `finally` so the process group is destroyed.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    opts = from_argv(sys.argv[1:] if argv is None else argv)
    env = DistEnv.from_environ(os.environ)
    try:
        validate(opts, world_size=env.world_size)
        checkpoint = initial_checkpoint(opts, env=env)
    except (UsageError, CheckpointError) as error:
        return _bad_input(error, env=env)
    try:
        device = pick_device(env)
        store = init_distributed(opts, env=env, device=device)
        return run(opts, env=env, device=device, store=store, checkpoint=checkpoint, began=began)
    except (UsageError, CheckpointError) as error:
        return _bad_input(error, env=env)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _bad_input(error: Exception, *, env: DistEnv) -> int:
    """Every rank says it: the failure panel shows whichever rank exits first, not always rank 0."""
    print(f"ddprun train: error: {getattr(error, 'message', error)}", file=sys.stderr)
    if getattr(error, "hint", None):
        print(f"  hint: {error.hint}", file=sys.stderr)
    return 2


def initial_checkpoint(opts: TrainOptions, *, env: DistEnv) -> Optional[dict]:
    """The checkpoint to start from: --resume, or last.pt after torch elastic restarted the workers."""
    path = opts.checkpoint_path
    if path is None:
        return None
    restarted = env.restart_count > 0 and os.path.isfile(path)
    if not (opts.resume or restarted):
        return None
    state = load_checkpoint(path)
    for name in _SHAPE_ARGS:
        if state["args"][name] != getattr(opts, name):
            raise CheckpointError(f"checkpoint {path} was written with --{name.replace('_', '-')} "
                                  f"{state['args'][name]}, this run has {getattr(opts, name)}")
    return state


def pick_device(env: DistEnv) -> torch.device:
    """CUDA when every local rank gets its own GPU (all ranks of a node decide alike), else CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= env.local_world_size:
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_distributed(opts: TrainOptions, *, env: DistEnv, device: torch.device) -> dist.Store:
    """The process group; returns its store, through which ranks can still check in after a collective hangs."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    # NCCL's watchdog aborts a collective stuck longer than this; gloo raises after it.
    timeout = timedelta(seconds=opts.collective_timeout)
    device_id = device if device.type == "cuda" else None
    if env.launched:
        store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
        # torch elastic keeps one store across restarts; the previous round's keys (dead peers' addresses)
        # would make a restarted gloo group connect to ranks that no longer exist. A prefix per round avoids it.
        store = dist.PrefixStore(f"ddprun/restart-{env.restart_count}", store)
    else:
        store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout,
                            device_id=device_id)
    return store


def ready_barrier(opts: TrainOptions, *, device: torch.device) -> None:
    """All ranks finished setup. On gloo a rank that never arrives is named, instead of a silent hang."""
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
        return
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=opts.collective_timeout), wait_all_ranks=True)
    except RuntimeError as error:
        raise RuntimeError(f"ranks did not all finish setup within --collective-timeout "
                           f"{opts.collective_timeout:g} s: {error}") from None


def name_silent_ranks(work: Callable[[], T], *, opts: TrainOptions, env: DistEnv, device: torch.device,
                      store: dist.Store) -> T:
    """A collective that timed out on gloo only says it waited, and leaves the group unusable.
    Every rank still alive then checks in through the store, so the error names the ranks
    that did not answer."""
    try:
        return work()
    except RuntimeError as error:
        if device.type == "cuda" or "timed out" not in str(error).lower():
            raise
        missing = silent_ranks(store, rank=env.rank, world_size=env.world_size,
                               wait_s=min(opts.collective_timeout, 30.0))
        if not missing:
            raise
        who = ", ".join(map(str, missing))
        raise RuntimeError(f"a collective timed out after --collective-timeout {opts.collective_timeout:g} s: "
                           f"rank{'s' if len(missing) > 1 else ''} {who} did not answer") from None


def silent_ranks(store: dist.Store, *, rank: int, world_size: int, wait_s: float) -> list[int]:
    """Check in, then list the ranks that have not checked in within `wait_s` seconds."""
    key = "ddprun/alive/{}".format
    store.set(key(rank), "1")
    deadline = time.monotonic() + wait_s
    while True:
        missing = [r for r in range(world_size) if not store.check([key(r)])]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.2)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed)


def build_components(opts: TrainOptions, *, env: DistEnv, data: TrainData, device: torch.device,
                     steps: "StepPlan", reporter) -> Components:
    seed_everything(opts.seed)  # identical initial weights on every rank
    raw = build_model(opts.model, num_classes=data.num_classes, image_size=opts.image_size)
    if opts.sync_bn and device.type == "cuda":
        raw = nn.SyncBatchNorm.convert_sync_batchnorm(raw)
    elif opts.sync_bn:
        reporter.note("note: --sync-bn has no effect on CPU (SyncBatchNorm needs CUDA); using plain batch norm")
    raw = raw.to(device, memory_format=torch.channels_last if opts.channels_last else torch.preserve_format)
    ddp = wrap_ddp(raw, opts=opts, device=device, world_size=env.world_size)
    grad_allreduce = attach_allreduce(ddp, opts=opts, env=env, device=device, reporter=reporter)
    forward = torch.compile(ddp) if opts.compile else ddp
    optimizer = build_optimizer(opts, raw.parameters(), global_batch=global_batch(opts, env))
    scheduler = schedule.build_scheduler(optimizer, kind=opts.lr_schedule, warmup=steps.warmup,
                                         horizon=steps.horizon)
    use_scaler = opts.amp == "fp16"
    scaler = torch.amp.GradScaler(device.type) if use_scaler else None
    amp_dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[opts.amp]
    return Components(raw=raw, ddp=ddp, forward=forward, optimizer=optimizer, scaler=scaler,
                      amp_dtype=amp_dtype, device=device, data=data, grads_in_buckets=grads_in_buckets(device),
                      grad_allreduce=grad_allreduce, scheduler=scheduler, label_smoothing=opts.label_smoothing,
                      clip_grad_norm=opts.clip_grad_norm)


def global_batch(opts: TrainOptions, env: DistEnv) -> int:
    return env.world_size * opts.batch_size * opts.grad_accum


def wrap_ddp(raw: nn.Module, *, opts: TrainOptions, device: torch.device, world_size: int) -> DDP:
    ddp = DDP(
        raw, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=opts.bucket_cap_mb,
        gradient_as_bucket_view=grads_in_buckets(device), static_graph=opts.static_graph,
    )
    # One process sends nothing, so compressing would only add work per step.
    if opts.grad_compression != "none" and world_size > 1:
        register_compression(ddp, opts.grad_compression)
    return ddp


def attach_allreduce(ddp: DDP, *, opts: TrainOptions, env: DistEnv, device: torch.device, reporter) -> str:
    """Put the shared-memory all-reduce in DDP where it can serve; returns what all-reduces: "shm" or the backend.
    --grad-allreduce auto falls back to the backend quietly where shm does not apply, with a note where it
    should have and could not be set up (a small /dev/shm in a container); shm makes either an error."""
    backend = dist.get_backend()
    if opts.grad_allreduce == "backend" or env.world_size < 2:  # one process: DDP reduces nothing anyway
        return backend
    reason = shm_does_not_apply(opts, env=env, device=device)
    if reason is None:
        try:
            state = ShmAllreduce.create(rank=env.rank, world_size=env.world_size,
                                        capacity=capacity_for(ddp.parameters()), exchange=_all_gather,
                                        timeout_s=opts.collective_timeout)
            ddp.register_comm_hook(state=state, hook=shm_allreduce_hook)
            return "shm"
        except SharedMemoryUnavailable as error:
            reason = str(error)
            if opts.grad_allreduce == "auto":
                reporter.note(f"note: gradients go through {backend}: {reason}")
    if opts.grad_allreduce == "shm":
        raise UsageError(f"--grad-allreduce shm: {reason}", hint="use --grad-allreduce auto or backend")
    return backend


def shm_does_not_apply(opts: TrainOptions, *, env: DistEnv, device: torch.device) -> Optional[str]:
    if device.type != "cpu":
        return f"it averages CPU gradients, and this job trains on {device.type}"
    if env.local_world_size != env.world_size:
        return f"the {env.world_size} ranks are not all on this host ({env.local_world_size} are)"
    if opts.grad_compression != "none":
        return f"--grad-compression {opts.grad_compression} goes through the backend"
    return None


def _all_gather(value) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


# PowerSGD sends plain all-reduced gradients for this many steps before compressing (torch needs > 1
# with error feedback); its state is not checkpointed, so a resumed run goes through the warm-up again.
POWERSGD_WARMUP_STEPS = 10
POWERSGD_RANK = 1  # torch's default; the cheapest to orthogonalise on one CPU core


def register_compression(ddp: DDP, kind: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=POWERSGD_WARMUP_STEPS,
            use_error_feedback=True, warm_start=True,
        )
        ddp.register_comm_hook(state=state, hook=_powersgd_in_order)
        return
    hook = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
    ddp.register_comm_hook(state=None, hook=hook[kind])


def _powersgd_in_order(state, bucket):  # unannotated: DDP checks hook annotations against real classes
    """PowerSGD chains its all-reduces in callbacks that run on gloo's threads, so two buckets' collectives
    can interleave differently on each rank (a size mismatch that aborts the job); finishing each bucket
    before the next is launched keeps the order. On CPU both cores compute anyway: nothing overlaps to lose."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    future = powerSGD_hook(state, bucket)
    future.wait()
    return future


def grads_in_buckets(device: torch.device) -> bool:
    """Gradients as bucket views save a copy and memory per step on GPU; on CPU they measured
    about 15% slower for resnet18 at one process and no faster at two, so CPU keeps separate grads."""
    return device.type == "cuda"


def build_optimizer(opts: TrainOptions, parameters, *, global_batch: int) -> torch.optim.Optimizer:
    lr = schedule.learning_rate(opts, global_batch=global_batch)
    decay = schedule.weight_decay(opts)
    if opts.optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=lr, weight_decay=decay)
    return torch.optim.SGD(parameters, lr=lr, momentum=schedule.SGD_MOMENTUM, weight_decay=decay)


def train_step(c: Components, micro_batches: Sequence[Batch]) -> torch.Tensor:
    """One optimizer step over `micro_batches`; gradients are all-reduced only on the last one."""
    count = len(micro_batches)
    total = None
    for index, (images, labels) in enumerate(micro_batches):
        last = index == count - 1
        with contextlib.nullcontext() if last else c.ddp.no_sync():
            with c.autocast():
                loss = F.cross_entropy(c.forward(images), labels, label_smoothing=c.label_smoothing)
            scaled = loss if count == 1 else loss / count
            (scaled if c.scaler is None else c.scaler.scale(scaled)).backward()
        total = loss.detach() if total is None else total + loss.detach()
    if c.clip_grad_norm is not None:
        if c.scaler is not None:
            c.scaler.unscale_(c.optimizer)  # clip the true gradients, not the loss-scaled ones
        nn.utils.clip_grad_norm_(c.raw.parameters(), c.clip_grad_norm)
    if c.scaler is None:
        c.optimizer.step()
    else:
        c.scaler.step(c.optimizer)
        c.scaler.update()
    c.scheduler.step()
    # With bucket views, zeroing in place keeps each .grad aliased to its bucket (no copy next step).
    c.optimizer.zero_grad(set_to_none=not c.grads_in_buckets)
    return total if count == 1 else total / count


class StepClock:
    """Steady-state training time: skips `warmup` steps, and everything between epoch loops."""

    def __init__(self, *, warmup: int, device: torch.device) -> None:
        self.warmup, self.device = warmup, device
        self.seen = self.measured_steps = 0
        self.seconds = self.cpu_seconds = 0.0  # wall time; CPU time of this process, all its threads
        self._mark: Optional[tuple[float, float]] = None

    def _now(self) -> tuple[float, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter(), time.process_time()

    def begin(self) -> None:
        if self.seen >= self.warmup:
            self._mark = self._now()

    def tick(self) -> None:
        self.seen += 1
        if self._mark is not None:
            self.measured_steps += 1
        elif self.seen == self.warmup:
            self._mark = self._now()

    def end(self) -> None:
        if self._mark is not None:
            (wall, cpu), (wall0, cpu0) = self._now(), self._mark
            self.seconds += wall - wall0
            self.cpu_seconds += cpu - cpu0
            self._mark = None


def run_epoch(c: Components, pos: Position, *, opts: TrainOptions, total_steps: int, clock: StepClock,
              reporter, after_step: Callable[[torch.Tensor], None]) -> tuple[torch.Tensor, int]:
    """Train from `pos` to the end of its epoch or to `total_steps`; returns (sum of step losses, steps).
    `after_step(loss)` runs after each step (step-interval checkpoints: every rank calls it alike)."""
    accum = opts.grad_accum
    steps_in_epoch = c.data.train.batches_per_epoch // accum
    batches = c.data.train.batches(pos.epoch, skip=pos.batch_in_epoch)
    loss_sum, count = torch.zeros((), device=c.device), 0
    clock.begin()
    for _ in range(pos.batch_in_epoch // accum, steps_in_epoch):
        if pos.step >= total_steps:
            break
        loss = train_step(c, [next(batches) for _ in range(accum)])
        loss_sum += loss
        count += 1
        pos.step += 1
        pos.batch_in_epoch += accum
        if pos.batch_in_epoch >= steps_in_epoch * accum:
            pos.epoch, pos.batch_in_epoch = pos.epoch + 1, 0
        clock.tick()
        reporter.step(pos.step, loss.item)
        after_step(loss)
    clock.end()
    return loss_sum, count


def mean_over_ranks(total: torch.Tensor, count: int) -> Optional[float]:
    both = torch.stack([total.double(), torch.tensor(float(count), dtype=torch.float64, device=total.device)])
    dist.all_reduce(both)
    return None if both[1].item() == 0 else (both[0] / both[1]).item()


@torch.no_grad()
def evaluate(c: Components) -> tuple[Optional[float], int]:
    """(accuracy, samples) on the validation set: each rank its own shard, correct and total all-reduced."""
    if c.data.val is None:
        return None, 0
    c.raw.eval()  # the raw module: shards differ in length, so no DDP collectives in here
    counts = torch.zeros(2, dtype=torch.float64, device=c.device)
    for images, labels in c.data.val.batches():
        with c.autocast():
            predicted = c.raw(images).argmax(dim=1)
        counts[0] += (predicted == labels).sum()
        counts[1] += labels.numel()
    c.raw.train()
    dist.all_reduce(counts)
    correct, total = counts.tolist()
    return (correct / total if total else None), int(total)


def save_checkpoint(c: Components, pos: Position, *, opts: TrainOptions, env: DistEnv,
                    best_val_accuracy: Optional[float], paths: Sequence[str]) -> None:
    """Rank 0 writes each of `paths` atomically with every rank's RNG state; all ranks wait for it."""
    rng_states = _all_gather(capture_rng())
    if env.rank == 0:
        state = {
            "format": FORMAT_VERSION, "model": c.raw.state_dict(), "optimizer": c.optimizer.state_dict(),
            "scaler": None if c.scaler is None else c.scaler.state_dict(), "schedule": c.scheduler.state_dict(),
            "epoch": pos.epoch, "batch_in_epoch": pos.batch_in_epoch, "step": pos.step,
            "world_size": env.world_size, "rng": rng_states, "args": dataclasses.asdict(opts),
            "best_val_accuracy": best_val_accuracy,
        }
        for path in paths:
            save_atomic(state, path)
    dist.barrier()


def check_fits(model: nn.Module, checkpoint: dict, *, path: str) -> None:
    """CheckpointError naming the first weight this run's model lacks, does not know, or shapes otherwise."""
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    saved = {name: tuple(tensor.shape) for name, tensor in checkpoint["model"].items()}
    for name in expected:
        if name not in saved:
            raise CheckpointError(f"checkpoint {path} has no weight {name!r} for this run's {checkpoint['args']['model']}")
        if saved[name] != expected[name]:
            raise CheckpointError(f"checkpoint {path}: weight {name!r} has shape {list(saved[name])}, this run's "
                                  f"model needs {list(expected[name])} (another --num-classes or --image-size?)")
    extra = sorted(set(saved) - set(expected))
    if extra:
        raise CheckpointError(f"checkpoint {path} has weight {extra[0]!r}, which this run's model does not have")


def restore(c: Components, checkpoint: dict, *, opts: TrainOptions, env: DistEnv) -> Position:
    check_fits(c.raw, checkpoint, path=opts.checkpoint_path)
    c.raw.load_state_dict(checkpoint["model"])
    try:
        c.optimizer.load_state_dict(checkpoint["optimizer"])
        c.scheduler.load_state_dict(checkpoint["schedule"])
        if c.scaler is not None and checkpoint["scaler"]:
            c.scaler.load_state_dict(checkpoint["scaler"])
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"checkpoint {opts.checkpoint_path}: its optimizer, lr schedule or scaler state "
                              f"does not fit this run: {first}") from None
    if checkpoint["world_size"] == env.world_size:
        restore_rng(checkpoint["rng"][env.rank])
    else:  # another world size: RNG streams cannot continue exactly; stay deterministic
        seed_everything(opts.seed + env.rank + checkpoint["step"])
    return Position(epoch=checkpoint["epoch"], batch_in_epoch=checkpoint["batch_in_epoch"], step=checkpoint["step"])


def peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        value, kind = torch.cuda.max_memory_allocated(device), "cuda"
    else:  # ru_maxrss is in KiB on Linux
        value, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss"
    peak = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item()), kind


@dataclass(frozen=True)
class StepPlan:
    per_epoch: int  # optimizer steps per epoch
    total: int  # steps this run trains to: --epochs, or --max-steps when that comes first
    horizon: int  # the lr schedule's length: --epochs x per_epoch (--max-steps stops early, it does not rescale)
    warmup: int  # linear warmup steps at the start of the schedule


def plan_steps(opts: TrainOptions, *, data: TrainData, world_size: int) -> StepPlan:
    """The run's step counts; UsageError when an epoch holds no full step or the warmup fills the run."""
    per_epoch = data.train.batches_per_epoch // opts.grad_accum
    if per_epoch == 0:
        raise UsageError(
            f"the training set gives no full step: world size {world_size} x --batch-size {opts.batch_size}"
            f" x --grad-accum {opts.grad_accum} is more than one epoch holds",
            hint="use a smaller --batch-size or --grad-accum, or more data",
        )
    horizon = opts.epochs * per_epoch
    check_warmup_steps(opts, schedule_steps=horizon)
    return StepPlan(per_epoch=per_epoch, total=horizon if opts.max_steps is None else min(horizon, opts.max_steps),
                    horizon=horizon, warmup=schedule.warmup_steps(opts, per_epoch=per_epoch, horizon=horizon))


def run(opts: TrainOptions, *, env: DistEnv, device: torch.device, store: dist.Store, checkpoint: Optional[dict],
        began: float) -> int:
    placement = Placement(device=device, channels_last=opts.channels_last)
    data = build_data(opts, rank=env.rank, world_size=env.world_size, placement=placement)
    steps = plan_steps(opts, data=data, world_size=env.world_size)
    reporter = NullReporter()
    if env.rank == 0:
        reporter = Reporter(total_steps=steps.total, start_step=checkpoint["step"] if checkpoint else 0,
                            epochs=opts.epochs, global_batch=global_batch(opts, env), log_interval=opts.log_interval)
    try:
        _announce(opts, env=env, device=device, steps=steps, reporter=reporter)

        def setup_and_train() -> tuple[Components, Position, LoopOutcome]:
            c = build_components(opts, env=env, data=data, device=device, steps=steps, reporter=reporter)
            pos = _start_position(c, checkpoint, opts=opts, env=env, reporter=reporter)
            ready_barrier(opts, device=device)
            best = checkpoint["best_val_accuracy"] if checkpoint else None
            return c, pos, train_loop(c, pos, opts=opts, env=env, total_steps=steps.total, reporter=reporter,
                                      best_val_accuracy=best)

        c, pos, outcome = name_silent_ranks(setup_and_train, opts=opts, env=env, device=device, store=store)
    finally:
        reporter.close()
    summary = _summarize(c, pos, outcome, opts=opts, env=env, checkpoint=checkpoint, began=began)
    if env.rank == 0:
        reporter.summary(summary)
        if opts.metrics_json:
            write_metrics(summary, opts.metrics_json)
    dist.barrier()  # tear down together: a rank that leaves early can abort in gloo's teardown
    return 0


def _start_position(c: Components, checkpoint: Optional[dict], *, opts: TrainOptions, env: DistEnv,
                    reporter) -> Position:
    if env.rank == 0 and opts.checkpoint_path:
        remove_stale_temps(opts.checkpoint_path)
    if checkpoint is None:
        if env.rank == 0 and opts.checkpoint_path and os.path.isfile(opts.checkpoint_path):
            reporter.note(f"note: starting fresh; {opts.checkpoint_path} will be overwritten (--resume continues it)")
        seed_everything(opts.seed + env.rank)  # ranks draw different random numbers from here on
        return Position()
    pos = restore(c, checkpoint, opts=opts, env=env)
    where = f"after epoch {pos.epoch}" if pos.batch_in_epoch == 0 else f"within epoch {pos.epoch + 1}"
    reporter.note(f"resuming from {opts.checkpoint_path} {where}, step {pos.step}"
                  + (f" (restart {env.restart_count})" if env.restart_count else ""))
    return pos


def _announce(opts: TrainOptions, *, env: DistEnv, device: torch.device, steps: StepPlan, reporter) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    accumulation = f" x {opts.grad_accum} accumulation" if opts.grad_accum > 1 else ""
    lr = schedule.learning_rate(opts, global_batch=global_batch(opts, env))
    reporter.note(
        f"ddprun train: {opts.model} on {opts.data} data, {env.world_size} process(es) x batch {opts.batch_size}"
        f"{accumulation} = {global_batch(opts, env)} global, {backend} on "
        f"{device.type}, {steps.per_epoch} steps/epoch, {steps.total} steps in total"
    )
    reporter.note(f"recipe: {opts.optimizer} lr {lr:g}, {steps.warmup} warmup steps then {opts.lr_schedule} "
                  f"over {steps.horizon}, weight decay {schedule.weight_decay(opts):g}, label smoothing "
                  f"{opts.label_smoothing:g}" + (f", gradient norm clipped at {opts.clip_grad_norm:g}"
                                                 if opts.clip_grad_norm is not None else ""))


@dataclass
class LoopOutcome:
    final_loss: Optional[float] = None
    val_accuracy: Optional[float] = None
    val_samples: int = 0
    epochs_run: int = 0
    clock: Optional[StepClock] = None
    best_val_accuracy: Optional[float] = None  # over the whole run, resumed parts included
    first_step_loss: Optional[float] = None  # rank 0's loss at step 1, when this run trained it
    last_step: Optional[torch.Tensor] = None  # rank 0's loss at the last step trained
    history: list = dataclasses.field(default_factory=list)  # one record per epoch run
    save_due: bool = False  # a step interval ended with an epoch: saved after that epoch's evaluation


def train_loop(c: Components, pos: Position, *, opts: TrainOptions, env: DistEnv, total_steps: int,
               reporter, best_val_accuracy: Optional[float] = None) -> LoopOutcome:
    outcome = LoopOutcome(clock=StepClock(warmup=min(5, (total_steps - pos.step) // 5), device=c.device),
                          best_val_accuracy=best_val_accuracy)
    if pos.epoch >= opts.epochs or pos.step >= total_steps:
        reporter.note(f"nothing to train: the checkpoint is at epoch {pos.epoch}, step {pos.step} "
                      f"(raise --epochs or --max-steps to continue)")

    def after_step(loss: torch.Tensor) -> None:
        if pos.step == 1:
            outcome.first_step_loss = loss.item()
        outcome.last_step = loss
        if opts.checkpoint_dir and opts.save_interval.unit == "steps" and pos.step % opts.save_interval.count == 0:
            if pos.batch_in_epoch == 0:  # evaluation draws random numbers too: save after it, as a resume would
                outcome.save_due = True
            else:
                save_checkpoint(c, pos, opts=opts, env=env, best_val_accuracy=outcome.best_val_accuracy,
                                paths=[opts.checkpoint_path])

    while pos.epoch < opts.epochs and pos.step < total_steps:
        epoch = pos.epoch
        reporter.start_epoch(epoch)
        loss_sum, count = run_epoch(c, pos, opts=opts, total_steps=total_steps, clock=outcome.clock,
                                    reporter=reporter, after_step=after_step)
        end_of_epoch(c, pos, outcome, epoch=epoch, loss=mean_over_ranks(loss_sum, count), opts=opts, env=env,
                     total_steps=total_steps, reporter=reporter)
    return outcome


def end_of_epoch(c: Components, pos: Position, outcome: LoopOutcome, *, epoch: int, loss: Optional[float],
                 opts: TrainOptions, env: DistEnv, total_steps: int, reporter) -> None:
    """Evaluate, report, and write last.pt when due and best.pt when validation accuracy improved."""
    outcome.final_loss = loss
    outcome.val_accuracy, outcome.val_samples = evaluate(c)
    outcome.epochs_run += 1
    lr = c.scheduler.get_last_lr()[0]
    outcome.history.append({"epoch": epoch + 1, "step": pos.step, "loss": loss,
                            "val_accuracy": outcome.val_accuracy, "lr": lr})
    reporter.end_epoch(epoch, loss=loss, val_accuracy=outcome.val_accuracy, lr=lr,
                       stopped_at=None if pos.epoch > epoch else pos.step)
    improved = outcome.val_accuracy is not None and (outcome.best_val_accuracy is None
                                                     or outcome.val_accuracy > outcome.best_val_accuracy)
    if improved:
        outcome.best_val_accuracy = outcome.val_accuracy
    if not opts.checkpoint_dir:
        return
    every = opts.save_interval
    due = (pos.epoch >= opts.epochs or pos.step >= total_steps or outcome.save_due
           or (every.unit == "epochs" and pos.batch_in_epoch == 0 and pos.epoch % every.count == 0))
    outcome.save_due = False
    paths = ([opts.checkpoint_path] if due else []) + ([opts.best_checkpoint_path] if improved else [])
    if paths:
        save_checkpoint(c, pos, opts=opts, env=env, best_val_accuracy=outcome.best_val_accuracy, paths=paths)


def _summarize(c: Components, pos: Position, outcome: LoopOutcome, *, opts: TrainOptions, env: DistEnv,
               checkpoint: Optional[dict], began: float) -> RunSummary:
    global_batch = env.world_size * opts.batch_size * opts.grad_accum
    clock = outcome.clock
    speed = clock.measured_steps * global_batch / clock.seconds if clock.measured_steps and clock.seconds else None
    memory, kind = peak_memory(c.device)
    return RunSummary(
        world_size=env.world_size, global_batch_size=global_batch, batch_size_per_process=opts.batch_size,
        steps=pos.step, epochs=pos.epoch, samples_per_sec=speed,
        cpu_seconds_per_step=clock.cpu_seconds / clock.measured_steps if clock.measured_steps else None,
        samples_per_sec_per_process=None if speed is None else speed / env.world_size,
        wall_time_s=time.perf_counter() - began, final_loss=outcome.final_loss,
        val_accuracy=outcome.val_accuracy, val_samples=outcome.val_samples, peak_memory_bytes=memory,
        peak_memory_kind=kind, model=opts.model, device=c.device.type, grad_allreduce=c.grad_allreduce,
        resumed_from_step=checkpoint["step"] if checkpoint else None,
        best_val_accuracy=outcome.best_val_accuracy, first_step_loss=outcome.first_step_loss,
        last_step_loss=None if outcome.last_step is None else outcome.last_step.item(),
        history=tuple(outcome.history),
    )


def leave(code: int) -> None:
    """End the process after a run that returned, skipping the interpreter's teardown.

    DDP's reducer keeps the gloo process group and its native threads alive past
    destroy_process_group, so they are still running while the interpreter tears itself down;
    a finished rank has been seen to abort there (SIGABRT, "terminate called without an active
    exception"), turning a complete run into a failed one. Every file the trainer writes is
    closed by now; exit handlers still run, with the interpreter intact."""
    torch_internals.run_exit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
