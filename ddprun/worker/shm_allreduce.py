"""DDP's gradient all-reduce through shared memory, for CPU ranks that share one host.

On gloo every bucket travels through loopback TCP: copies into and out of the kernel on both
sides, socket wake-ups and gloo's own threads, all paid by the cores that are computing the
backward pass. Ranks on one host can average in shared memory instead:

  1. each rank writes its bucket, divided by the world size, into its own slot;
  2. the ranks wait for each other (each rank has a pipe that the others write a wake-up to);
  3. rank r sums the r-th 1/W of every slot into a result region that all ranks map;
  4. they wait again: the result region holds the mean, and DDP copies it into .grad as usual.

Every part of the result is summed by exactly one rank in rank order, so all replicas read the
same bits. The hook is synchronous: on CPU both cores already compute, so there is nothing for
an asynchronous all-reduce to overlap with (BENCHMARKS.md measures it).

Nothing has a name: slots and the result are memfds and the wake-ups anonymous pipes, which the
peers open through /proc/<owner pid>/fd/<fd> (the kernel allows that to the same user, as for
ptrace reads). The memory goes away with the last process that maps it, whenever any rank or the
launcher is killed. Where a peer's /proc/<pid>/fd cannot be opened (a rank made non-dumpable),
the group falls back to 0600 files and FIFOs in /dev/shm, unlinked once every rank has opened
them: only a kill in those few milliseconds can leave them behind.
"""

from __future__ import annotations

import errno
import os
import secrets
import select
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

SHM_DIR = "/dev/shm"
ALIGN = 64  # bytes: buckets and ranks' shares start on their own cache line
_MESSAGE = 2  # bytes per wake-up: the sender's rank (writes up to PIPE_BUF are atomic)
_MIB = 2**20

# exchange(value) -> every rank's value, in rank order; a collective, like dist.all_gather_object.
Exchange = Callable[[Any], list]
# What a rank publishes of each object it created: the path a peer opens, and the (st_dev, st_ino)
# the peer must find there (a pid reused by another process of the same user holds other files).
Address = tuple[str, int, int]


class SharedMemoryUnavailable(Exception):
    """Raised on every rank alike when any rank cannot set up or reach the shared memory."""


class ShmAllreduce:
    """The shared state of one group of ranks: slots, result region, wake-up pipes."""

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
        Returns on every rank or raises SharedMemoryUnavailable on every rank. `directory` holds the
        named files of the fallback, used only where the nameless setup fails."""
        if world_size < 2:
            raise SharedMemoryUnavailable("one process has nothing to all-reduce")
        settings = dict(rank=rank, world_size=world_size, capacity=capacity, exchange=exchange, timeout_s=timeout_s)
        try:
            return cls._set_up(_Nameless(), **settings)
        except SharedMemoryUnavailable:  # every rank alike, so every rank tries the files
            return cls._set_up(_Named(directory), **settings)

    @classmethod
    def _set_up(cls, objects: "_Nameless | _Named", *, rank: int, world_size: int, capacity: int,
                exchange: Exchange, timeout_s: float) -> "ShmAllreduce":
        try:
            made = _attempt(lambda: objects.make(rank=rank, world_size=world_size, capacity=capacity))
            addresses = _agree(exchange, made, "set up")
            state = _attempt(lambda: cls(rank=rank, world_size=world_size, timeout_s=timeout_s,
                                         **_open_all(addresses, rank=rank, capacity=capacity)))
            try:
                _agree(exchange, state, "reach")
            except SharedMemoryUnavailable:
                if isinstance(state, cls):
                    state.close()
                raise
        finally:
            objects.release()  # every rank has opened them, or the setup is abandoned
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


class _Nameless:
    """One rank's objects as memfds and a pipe, reached through /proc/<pid>/fd: no name anywhere."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def make(self, *, rank: int, world_size: int, capacity: int) -> dict[str, Address]:
        _check_memory(capacity=capacity, world_size=world_size)
        made = {"slot": self._memory(f"ddprun-rank{rank}.grad", capacity)}
        if rank == 0:
            made["result"] = self._memory("ddprun-result.grad", capacity)
        read_end, write_end = os.pipe()  # the write end only keeps the pipe whole until peers open it
        self.fds += [read_end, write_end]
        made["wake"] = self._address(read_end)
        return made

    def _memory(self, name: str, capacity: int) -> Address:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        self.fds.append(fd)
        os.fchmod(fd, 0o600)  # a memfd starts 0777; /proc access already needs the same user
        os.posix_fallocate(fd, 0, capacity)  # pages charged now, not as SIGBUS mid-step
        return self._address(fd)

    def _address(self, fd: int) -> Address:
        info = os.fstat(fd)
        return f"/proc/{os.getpid()}/fd/{fd}", info.st_dev, info.st_ino

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class _Named:
    """One rank's objects as 0600 files and a FIFO in `directory`, unlinked once every rank opened them."""

    def __init__(self, directory: str) -> None:
        self.directory, self.created = directory, []

    def make(self, *, rank: int, world_size: int, capacity: int) -> dict[str, Address]:
        if not os.path.isdir(self.directory):
            raise OSError(errno.ENOENT, f"{self.directory} does not exist")
        _check_memory(capacity=capacity, world_size=world_size)  # tmpfs pages are memory too
        prefix = os.path.join(self.directory, f"ddprun-{secrets.token_hex(6)}-")
        made = {"slot": self._reserve(f"{prefix}rank{rank}.grad", capacity)}
        if rank == 0:
            made["result"] = self._reserve(f"{prefix}result.grad", capacity)
        os.mkfifo(f"{prefix}rank{rank}.wake", 0o600)
        self.created.append(f"{prefix}rank{rank}.wake")
        made["wake"] = _address_of(f"{prefix}rank{rank}.wake")
        return made

    def _reserve(self, path: str, capacity: int) -> Address:
        """Create and fully allocate `path` now, so a full tmpfs fails here and not as SIGBUS mid-step."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.created.append(path)
        try:
            os.posix_fallocate(fd, 0, capacity)
        except OSError as error:
            if error.errno == errno.ENOSPC:
                free = os.statvfs(self.directory)
                raise OSError(errno.ENOSPC, f"{self.directory} has {free.f_bavail * free.f_frsize / _MIB:.0f} MiB "
                                            f"free; each rank needs {capacity / _MIB:.0f} MiB") from None
            raise
        finally:
            os.close(fd)
        return _address_of(path)

    def release(self) -> None:
        for path in self.created:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.created = []


def _address_of(path: str) -> Address:
    info = os.stat(path)
    return path, info.st_dev, info.st_ino


def _open_all(addresses: list[dict[str, Address]], *, rank: int, capacity: int) -> dict:
    """ShmAllreduce's slots, result, wake_fd and peer_fds, from every rank's published addresses."""
    slots = [_map(made["slot"], capacity) for made in addresses]
    result = _map(addresses[0]["result"], capacity)
    wake_fd = _open(addresses[rank]["wake"], os.O_RDWR | os.O_NONBLOCK)  # RDWR: never EOF, never blocks
    peer_fds = {r: _open(made["wake"], os.O_RDWR) for r, made in enumerate(addresses) if r != rank}
    return dict(slots=slots, result=result, wake_fd=wake_fd, peer_fds=peer_fds)


def _open(address: Address, flags: int) -> int:
    """An fd of the object at `address`; refuses another object found at the same path."""
    path, device, inode = address
    fd = os.open(path, flags)
    info = os.fstat(fd)
    if (info.st_dev, info.st_ino) != (device, inode):
        os.close(fd)
        raise OSError(errno.ESTALE, f"{path} is no longer the object its owner created")
    return fd


def _map(address: Address, nbytes: int) -> torch.Tensor:
    fd = _open(address, os.O_RDWR)
    try:
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    finally:
        os.close(fd)  # the mapping keeps the memory


def _check_memory(*, capacity: int, world_size: int) -> None:
    """The group's slots and result must fit in the memory left to this job: memfd and tmpfs pages are
    shared memory, charged to the memory cgroup and the host, where exceeding them means an OOM kill.
    Every rank checks the whole group's need, before its own allocation, so none is counted twice."""
    need, room = capacity * (world_size + 1), memory_headroom()
    if room is not None and need > room:
        raise OSError(errno.ENOMEM, f"the group needs {need / _MIB:.0f} MiB of shared memory "
                                    f"({world_size + 1} x {capacity / _MIB:.0f} MiB) and this job has "
                                    f"{room / _MIB:.0f} MiB of memory left")


def memory_headroom() -> Optional[int]:
    """Bytes this process can still fill: the host's MemAvailable, lowered by any memory cgroup limit
    on the way to the root (v2 or v1); None where neither can be read."""
    rooms = [_meminfo_available()] + [_cgroup_room(directory, **names) for directory, names in _memory_cgroups()]
    known = [room for room in rooms if room is not None]
    return min(known) if known else None


def cgroup_room(*, limit: str, usage: str, stat_text: str, inactive_key: str) -> Optional[int]:
    """A memory cgroup's limit minus its working set (usage less inactive page cache, which the kernel
    reclaims first: kubelet's measure); None without a limit."""
    limit = limit.strip()
    if limit == "max" or int(limit) >= 1 << 62:  # v1 writes "no limit" as a huge number
        return None
    inactive = next((int(line.split()[1]) for line in stat_text.splitlines()
                     if line.split()[:1] == [inactive_key]), 0)
    return int(limit) - max(0, int(usage) - inactive)


_CGROUP_FILES = {  # limit, usage, the stat line of inactive page cache
    "v2": dict(limit="memory.max", usage="memory.current", inactive_key="inactive_file"),
    "v1": dict(limit="memory.limit_in_bytes", usage="memory.usage_in_bytes", inactive_key="total_inactive_file"),
}


def _memory_cgroups(root: str = "/sys/fs/cgroup") -> list[tuple[str, dict]]:
    """This process's memory cgroup directories, leaf to root, each with its file names."""
    found = []
    for line in _read("/proc/self/cgroup").splitlines():
        number, controllers, path = line.split(":", 2)
        if number == "0" and controllers == "":
            base, names = root, _CGROUP_FILES["v2"]
        elif "memory" in controllers.split(","):
            base, names = os.path.join(root, "memory"), _CGROUP_FILES["v1"]
        else:
            continue
        parts = [part for part in path.split("/") if part]
        found += [(os.path.join(base, *parts[:depth]), names) for depth in range(len(parts), -1, -1)]
    return found


def _cgroup_room(directory: str, *, limit: str, usage: str, inactive_key: str) -> Optional[int]:
    texts = [_read(os.path.join(directory, name)) for name in (limit, usage, "memory.stat")]
    if not texts[0] or not texts[1]:
        return None
    try:
        return cgroup_room(limit=texts[0], usage=texts[1], stat_text=texts[2], inactive_key=inactive_key)
    except ValueError:
        return None


def _meminfo_available() -> Optional[int]:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return ""


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _attempt(work: Callable[[], Any]) -> Any:
    """`work()`'s value, or why it failed (an OSError's text)."""
    try:
        return work()
    except OSError as error:
        return error.strerror if error.filename is None and error.strerror else str(error)
    except RuntimeError as error:  # torch.from_file's mmap
        return str(error)


def _agree(exchange: Exchange, outcome: Any, what: str) -> list:
    """Every rank learns whether any rank failed; each then raises the same SharedMemoryUnavailable.
    Returns every rank's outcome where none failed."""
    outcomes = exchange(outcome if not isinstance(outcome, ShmAllreduce) else None)
    failures = [(rank, reason) for rank, reason in enumerate(outcomes) if isinstance(reason, str)]
    if failures:
        rank, reason = failures[0]
        raise SharedMemoryUnavailable(f"rank {rank} could not {what} shared memory: {reason}")
    return outcomes
