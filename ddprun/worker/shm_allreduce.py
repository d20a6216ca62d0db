"""DDP's gradient all-reduce through shared memory, for CPU ranks that share one host.

On gloo every bucket travels through loopback TCP: copies into and out of the kernel on both
sides, socket wake-ups and gloo's own threads, all paid by the cores that are computing the
backward pass. Ranks on one host can average in shared memory instead:

  1. each rank writes its bucket, divided by the world size, into its own slot;
  2. the ranks wait for each other (each rank has a FIFO that the others write a wake-up to);
  3. rank r sums the r-th 1/W of every slot into a result region that all ranks map;
  4. they wait again: the result region holds the mean, and DDP copies it into .grad as usual.

Every part of the result is summed by exactly one rank in rank order, so all replicas read the
same bits. The hook is synchronous: on CPU both cores already compute, so there is nothing for
an asynchronous all-reduce to overlap with (BENCHMARKS.md measures it). The files are unlinked
as soon as every rank has mapped them: nothing stays in /dev/shm, even after kill -9.
"""

from __future__ import annotations

import errno
import os
import secrets
import select
import sys
import time
from typing import Any, Callable, Iterable, Sequence

import torch

SHM_DIR = "/dev/shm"
ALIGN = 64  # bytes: buckets and ranks' shares start on their own cache line
_MESSAGE = 2  # bytes per wake-up: the sender's rank (writes up to PIPE_BUF are atomic)

# exchange(value) -> every rank's value, in rank order; a collective, like dist.all_gather_object.
Exchange = Callable[[Any], list]


class SharedMemoryUnavailable(Exception):
    """Raised on every rank alike when any rank cannot set up or reach the shared memory."""


class ShmAllreduce:
    """The shared state of one group of ranks: slots, result region, wake-up FIFOs."""

    def __init__(self, *, rank: int, world_size: int, slots: Sequence[torch.Tensor], result: torch.Tensor,
                 wake_fd: int, peer_fds: dict[int, int], timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._slots, self._result = [slot.untyped_storage() for slot in slots], result.untyped_storage()
        self._wake_fd, self._peer_fds = wake_fd, peer_fds
        self._wake = select.poll()  # not select.select: a busy process can hold fds above FD_SETSIZE
        self._wake.register(wake_fd, select.POLLIN)
        self._arrivals = [0] * world_size  # wake-ups received from each rank
        self._waits = 0  # barriers this rank has entered
        self._cursor = 0  # where the next bucket's result goes in this backward pass
        self._views: dict[tuple, torch.Tensor] = {}

    @classmethod
    def create(cls, *, rank: int, world_size: int, capacity: int, exchange: Exchange, timeout_s: float,
               directory: str = SHM_DIR) -> "ShmAllreduce":
        """Collective: every rank calls it with the same `capacity` (see `capacity_for`).
        Returns on every rank or raises SharedMemoryUnavailable on every rank."""
        if world_size < 2:
            raise SharedMemoryUnavailable("one process has nothing to all-reduce")
        token = exchange(secrets.token_hex(6) if rank == 0 else None)[0]
        files = _Files(directory, token, rank=rank, world_size=world_size)
        try:
            _agree(exchange, _attempt(lambda: files.make(capacity)), "set up")
            state = _attempt(lambda: cls(rank=rank, world_size=world_size, timeout_s=timeout_s,
                                         **files.open_all(capacity)))
            try:
                _agree(exchange, state, "reach")
            except SharedMemoryUnavailable:
                if isinstance(state, cls):
                    state.close()
                raise
        finally:
            files.unlink_own()  # every rank has opened them, or the setup is abandoned
        return state

    def mean(self, bucket: torch.Tensor, *, first: bool) -> torch.Tensor:
        """The mean of `bucket` over all ranks, as a tensor in the result region (storage offset 0,
        as DDP's views of a hook's result require). `first` starts a new backward pass."""
        if first:
            self._cursor = 0
        nbytes = bucket.numel() * bucket.element_size()
        offset, self._cursor = self._cursor, _aligned(self._cursor + nbytes)
        if self._cursor > self._result.nbytes():
            raise RuntimeError(f"shared-memory all-reduce: buckets exceed the {self._result.nbytes()} bytes "
                               f"set up for the model's gradients")
        own = self._view(self._slots[self.rank], 0, bucket)
        torch.div(bucket, self.world_size, out=own)
        self._barrier()
        start, stop = self._share(bucket.numel(), bucket.element_size())
        result = self._view(self._result, offset, bucket)
        parts = [self._view(slot, 0, bucket)[start:stop] for slot in self._slots]
        total = torch.add(parts[0], parts[1], out=result[start:stop])
        for part in parts[2:]:
            total.add_(part)
        self._barrier()
        return result

    def close(self) -> None:
        for fd in (self._wake_fd, *self._peer_fds.values()):
            os.close(fd)
        self._peer_fds, self._views = {}, {}

    def _share(self, numel: int, element_size: int) -> tuple[int, int]:
        """This rank's [start, stop) of a bucket: contiguous 1/W parts, on cache-line boundaries."""
        per_line = max(1, ALIGN // element_size)
        bounds = [numel * r // self.world_size // per_line * per_line for r in range(self.world_size)] + [numel]
        return bounds[self.rank], bounds[self.rank + 1]

    def _view(self, storage: torch.UntypedStorage, offset: int, like: torch.Tensor) -> torch.Tensor:
        key = (storage.data_ptr(), offset, like.numel(), like.dtype)
        view = self._views.get(key)
        if view is None:
            part = storage[offset: offset + like.numel() * like.element_size()]
            view = self._views[key] = torch.empty(0, dtype=like.dtype).set_(part, 0, (like.numel(),))
        return view

    def _barrier(self) -> None:
        """Wait until every rank has entered as many barriers as this one."""
        self._waits += 1
        message = self.rank.to_bytes(_MESSAGE, sys.byteorder)
        for fd in self._peer_fds.values():
            os.write(fd, message)
        deadline = time.monotonic() + self.timeout_s
        while behind := [r for r in self._peer_fds if self._arrivals[r] < self._waits]:
            left = deadline - time.monotonic()
            if left <= 0 or not self._wake.poll(left * 1e3):
                ranks = ", ".join(map(str, behind))
                raise RuntimeError(f"shared-memory all-reduce timed out after {self.timeout_s:g} s: rank "
                                   f"{self.rank} waited for rank{'s' if len(behind) > 1 else ''} {ranks}")
            data = os.read(self._wake_fd, 4096)  # whole messages: each write was atomic
            for sender in memoryview(data).cast("H"):
                self._arrivals[sender] += 1


def capacity_for(parameters: Iterable[torch.Tensor]) -> int:
    """Bytes that hold every bucket DDP can make of `parameters`' gradients, each bucket aligned.
    (DDP's first backward pass puts all of them in one bucket; later ones follow bucket_cap_mb.)"""
    trained = [p for p in parameters if p.requires_grad]
    return sum(p.numel() * p.element_size() for p in trained) + ALIGN * (len(trained) + 1)


def shm_allreduce_hook(state: ShmAllreduce, bucket):  # bucket unannotated: DDP checks annotations
    """The DDP communication hook: the bucket's mean, already complete when it returns."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(state.mean(bucket.buffer(), first=bucket.index() == 0))
    return future


class _Files:
    """The files of one group in `directory`: a slot and a wake-up FIFO per rank, one result region."""

    def __init__(self, directory: str, token: str, *, rank: int, world_size: int) -> None:
        self.directory, self.rank, self.world_size = directory, rank, world_size
        self.prefix = os.path.join(directory, f"ddprun-{token}-")
        self.created: list[str] = []

    def slot(self, rank: int) -> str:
        return f"{self.prefix}rank{rank}.grad"

    def fifo(self, rank: int) -> str:
        return f"{self.prefix}rank{rank}.wake"

    @property
    def result(self) -> str:
        return f"{self.prefix}result.grad"

    def make(self, capacity: int) -> None:
        if not os.path.isdir(self.directory):
            raise OSError(errno.ENOENT, f"{self.directory} does not exist")
        for path in [self.slot(self.rank)] + ([self.result] if self.rank == 0 else []):
            self._reserve(path, capacity)
        os.mkfifo(self.fifo(self.rank), 0o600)
        self.created.append(self.fifo(self.rank))

    def _reserve(self, path: str, capacity: int) -> None:
        """Create and fully allocate `path` now, so a full tmpfs fails here and not as SIGBUS mid-step."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.created.append(path)
        try:
            os.posix_fallocate(fd, 0, capacity)
        except OSError as error:
            if error.errno == errno.ENOSPC:
                free = os.statvfs(self.directory)
                raise OSError(errno.ENOSPC, f"{self.directory} has {free.f_bavail * free.f_frsize / 2**20:.0f} MiB "
                                            f"free; each rank needs {capacity / 2**20:.0f} MiB") from None
            raise
        finally:
            os.close(fd)

    def open_all(self, capacity: int) -> dict:
        """ShmAllreduce's slots, result, wake_fd and peer_fds."""
        slots = [_map(self.slot(r), capacity) for r in range(self.world_size)]
        result = _map(self.result, capacity)
        wake_fd = os.open(self.fifo(self.rank), os.O_RDWR | os.O_NONBLOCK)  # RDWR: never EOF, never blocks
        peer_fds = {r: os.open(self.fifo(r), os.O_RDWR) for r in range(self.world_size) if r != self.rank}
        return dict(slots=slots, result=result, wake_fd=wake_fd, peer_fds=peer_fds)

    def unlink_own(self) -> None:
        for path in self.created:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.created = []


def _map(path: str, nbytes: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _attempt(work: Callable[[], Any]) -> Any:
    """`work()`'s value, or why it failed (an OSError's text)."""
    try:
        return work()
    except OSError as error:
        return error.strerror if error.filename is None and error.strerror else str(error)


def _agree(exchange: Exchange, outcome: Any, what: str) -> None:
    """Every rank learns whether any rank failed; each then raises the same SharedMemoryUnavailable."""
    failures = [(rank, reason) for rank, reason in enumerate(exchange(outcome if isinstance(outcome, str) else None))
                if reason is not None]
    if failures:
        rank, reason = failures[0]
        raise SharedMemoryUnavailable(f"rank {rank} could not {what} shared memory: {reason}")
