"""The shared-memory all-reduce: ranks as threads of this process for its arithmetic, as processes (forked,
or started as another user) for what the kernel decides: who may open a rank's memory, and what is left
behind when ranks are killed during setup."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable

import pytest
import torch

from ddprun.worker.shm_allreduce import (
    ALIGN, SHM_DIR, SharedMemoryUnavailable, ShmAllreduce, capacity_for, cgroup_room, memory_headroom,
    shm_allreduce_hook,
)


class ThreadExchange:
    """all_gather_object for ranks that are threads."""

    def __init__(self, world_size: int) -> None:
        self.values: list = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=30)

    def for_rank(self, rank: int) -> Callable:
        def exchange(value):
            self.values[rank] = value
            self.barrier.wait()
            gathered = list(self.values)
            self.barrier.wait()
            return gathered
        return exchange


def on_ranks(world_size: int, work: Callable[[int, Callable], object]) -> list:
    """work(rank, exchange) on `world_size` threads at once; their results (or exceptions) in rank order."""
    exchange = ThreadExchange(world_size)

    def attempt(rank):
        try:
            return work(rank, exchange.for_rank(rank))
        except Exception as error:  # noqa: BLE001 - the test inspects it
            return error

    with ThreadPoolExecutor(world_size) as pool:
        return list(pool.map(attempt, range(world_size)))


def create(rank: int, exchange, *, world_size: int, directory, capacity: int = 1 << 16, timeout_s: float = 20):
    return ShmAllreduce.create(rank=rank, world_size=world_size, capacity=capacity, exchange=exchange,
                               timeout_s=timeout_s, directory=str(directory))


# Bucket sizes of two backward passes over parameters of PASSES[1]'s sizes: DDP's first pass is one bucket
# of everything, later ones follow the cap.
PASSES = [[1000], [7, 1, 600, 392]]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_mean_of_every_bucket_identical_on_every_rank(tmp_path, world_size, dtype):
    generator = torch.Generator().manual_seed(0)
    grads = [[[torch.randn(n, generator=generator).to(dtype) for n in sizes] for sizes in PASSES]
             for _ in range(world_size)]

    def work(rank, exchange):
        parameters = [torch.empty(n, dtype=dtype, requires_grad=True) for n in PASSES[1]]
        shm = create(rank, exchange, world_size=world_size, directory=tmp_path, capacity=capacity_for(parameters))
        results = []
        for buckets in grads[rank]:
            # Results of a pass stay valid until the next pass: DDP copies them out after the last bucket.
            outs = [shm.mean(bucket.clone(), first=index == 0) for index, bucket in enumerate(buckets)]
            results.append([out.clone() for out in outs])
            assert all(out.storage_offset() == 0 for out in outs)
        shm.close()
        return results

    results = on_ranks(world_size, work)
    for pass_index, sizes in enumerate(PASSES):
        for index in range(len(sizes)):
            expected = sum(grads[r][pass_index][index] / world_size for r in range(world_size))  # in rank order
            for rank in range(world_size):
                got = results[rank][pass_index][index]
                assert torch.equal(got, results[0][pass_index][index])  # bit-identical replicas
                torch.testing.assert_close(got, expected)


def ddprun_mappings() -> list[str]:
    """What this process maps of the all-reduce: the last field of /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split(maxsplit=5)[5].strip() for line in maps if "ddprun-" in line})


def shm_entries() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith("ddprun-")}


def test_nothing_has_a_name(tmp_path):
    before = shm_entries()

    def work(rank, exchange):
        shm = create(rank, exchange, world_size=2, directory=tmp_path)
        exchange(None)  # both ranks are set up
        seen = ddprun_mappings(), list(tmp_path.iterdir()), shm_entries() - before
        exchange(None)  # both ranks have looked
        shm.close()
        return seen

    for mappings, listing, new_entries in on_ranks(2, work):
        assert mappings == ["/memfd:ddprun-rank0.grad (deleted)", "/memfd:ddprun-rank1.grad (deleted)",
                            "/memfd:ddprun-result.grad (deleted)"]
        assert listing == [] and new_entries == set()


def test_memory_and_pipes_are_0600(tmp_path):
    def work(rank, exchange):
        shm = create(rank, exchange, world_size=2, directory=tmp_path)
        exchange(None)
        modes = [os.fstat(fd).st_mode & 0o777 for fd in (shm._wake_fd, *shm._peer_fds.values())]
        if os.geteuid() == 0:  # /proc/self/map_files needs CAP_SYS_ADMIN
            with open("/proc/self/maps") as maps:
                spans = [line.split()[0] for line in maps if "memfd:ddprun-" in line]
            modes += [os.stat(f"/proc/self/map_files/{span}").st_mode & 0o777 for span in spans]
        exchange(None)
        shm.close()
        return modes

    for modes in on_ranks(2, work):
        assert len(modes) >= 2 and set(modes) == {0o600}, [oct(mode) for mode in modes]


def test_every_rank_gives_up_alike_when_the_memory_is_not_there(tmp_path):
    def work(rank, exchange):
        return create(rank, exchange, world_size=2, directory=tmp_path, capacity=1 << 50)  # 1 PiB

    errors = on_ranks(2, work)
    assert all(isinstance(error, SharedMemoryUnavailable) for error in errors), errors
    assert str(errors[0]) == str(errors[1])
    assert "rank 0 could not set up shared memory: the group needs 3221225472 MiB" in str(errors[0])
    assert "MiB of memory left" in str(errors[0])
    assert list(tmp_path.iterdir()) == []


def test_cgroup_room_is_the_limit_less_the_working_set():
    stat_v2 = "anon 100\nfile 500\ninactive_file 300\nactive_file 200\n"
    assert cgroup_room(limit="1000\n", usage="800\n", stat_text=stat_v2, inactive_key="inactive_file") == 500
    assert cgroup_room(limit="max\n", usage="800\n", stat_text=stat_v2, inactive_key="inactive_file") is None
    assert cgroup_room(limit="9223372036854771712\n", usage="5", stat_text="", inactive_key="x") is None  # v1
    stat_v1 = "inactive_file 1\ntotal_inactive_file 40\n"
    assert cgroup_room(limit="100", usage="90", stat_text=stat_v1, inactive_key="total_inactive_file") == 50
    assert cgroup_room(limit="100", usage="90", stat_text="", inactive_key="inactive_file") == 10


def test_memory_headroom_is_at_most_what_the_host_has():
    with open("/proc/meminfo") as meminfo:
        total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    assert 0 < memory_headroom() <= total




def test_a_rank_that_never_arrives_is_named(tmp_path):
    def work(rank, exchange):
        shm = create(rank, exchange, world_size=3, directory=tmp_path, timeout_s=0.5)
        if rank == 2:
            return None  # stuck elsewhere: never enters the all-reduce
        try:
            return shm.mean(torch.ones(10), first=True)
        finally:
            shm.close()

    errors = on_ranks(3, work)
    for error in errors[:2]:
        assert isinstance(error, RuntimeError) and "timed out after 0.5 s" in str(error)
        assert str(error).endswith("waited for rank 2")


def test_one_process_has_nothing_to_reduce(tmp_path):
    with pytest.raises(SharedMemoryUnavailable, match="one process"):
        create(0, lambda value: [value], world_size=1, directory=tmp_path)


def test_capacity_counts_trained_parameters_and_alignment():
    trained, frozen = torch.empty(10, requires_grad=True), torch.empty(1000)
    half = torch.empty(3, dtype=torch.float16, requires_grad=True)
    assert capacity_for([trained, frozen, half]) == 40 + 6 + 3 * ALIGN


def test_hook_returns_a_completed_future(tmp_path):
    class Bucket:
        def __init__(self, tensor, index):
            self.tensor, self._index = tensor, index

        def buffer(self):
            return self.tensor

        def index(self):
            return self._index

    def work(rank, exchange):
        shm = create(rank, exchange, world_size=2, directory=tmp_path)
        future = shm_allreduce_hook(shm, Bucket(torch.full((5,), float(rank)), 0))
        assert future.done()
        value = future.value().clone()
        exchange(None)
        shm.close()
        return value

    assert all(torch.equal(value, torch.full((5,), 0.5)) for value in on_ranks(2, work))


# --- Ranks as processes -------------------------------------------------------------------------------

def relay(connections: list[Connection], gathered: list[list]) -> threading.Thread:
    """all_gather_object for ranks that are processes, until one of them is gone; each round's values
    are appended to `gathered`."""
    def serve():
        try:
            while True:
                values = [connection.recv() for connection in connections]
                for connection in connections:
                    connection.send(values)
                gathered.append(values)
        except (EOFError, OSError):
            return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


RANK_PROCESS = r"""
import ctypes, json, sys
from multiprocessing.connection import Connection
import torch
from ddprun.worker.shm_allreduce import SharedMemoryUnavailable, ShmAllreduce
fd, rank, world_size, directory, undumpable = map(sys.argv.__getitem__, range(1, 6))
rank, world_size, connection = int(rank), int(world_size), Connection(int(fd))
def exchange(value):
    connection.send(value)
    return connection.recv()
if undumpable == "1":
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the same user may not open /proc/<pid>/fd
try:
    shm = ShmAllreduce.create(rank=rank, world_size=world_size, capacity=1 << 16, exchange=exchange, timeout_s=20,
                              directory=directory)
except SharedMemoryUnavailable as error:
    print(json.dumps({"error": str(error)}))
    sys.exit()
with open("/proc/self/maps") as maps:
    mapped = sorted({line.split(maxsplit=5)[5].strip() for line in maps if "ddprun-" in line})
mean = shm.mean(torch.full((5,), float(rank)), first=True).tolist()
exchange(None)
print(json.dumps({"mapped": mapped, "mean": mean}))
"""


def as_other_user() -> list[str]:
    """A command prefix that starts a rank as an unprivileged user (root passes every access check)."""
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("root without setpriv cannot start ranks as another user")
    return ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]


def run_rank_processes(directories: list[str], *, undumpable: frozenset = frozenset()) -> list[dict]:
    """One process per directory (rank r uses directories[r]), as an unprivileged user; their reports."""
    prefix, pairs = as_other_user(), [socket.socketpair() for _ in directories]
    env = {**os.environ, "HOME": directories[0], "OMP_NUM_THREADS": "1"}
    processes = [subprocess.Popen(
        [*prefix, sys.executable, "-c", RANK_PROCESS, str(theirs.fileno()), str(rank), str(len(directories)),
         directory, "1" if rank in undumpable else "0"],
        pass_fds=[theirs.fileno()], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for rank, ((_, theirs), directory) in enumerate(zip(pairs, directories))]
    for _, theirs in pairs:
        theirs.close()
    relay([Connection(ours.detach()) for ours, _ in pairs], [])
    reports = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        reports.append(json.loads(out))
    return reports


@pytest.fixture
def shared_dir():
    """A directory the unprivileged ranks own (tmp_path's parents are private to root)."""
    with tempfile.TemporaryDirectory(prefix="shm-test-") as directory:
        if os.geteuid() == 0:
            os.chown(directory, 65534, 65534)
        yield Path(directory)


def test_sibling_processes_of_one_user_share_memfds_through_proc(shared_dir):
    for report in run_rank_processes([str(shared_dir)] * 2):
        assert report.get("mean") == [0.5] * 5, report
        assert len(report["mapped"]) == 3 and all(path.startswith("/memfd:ddprun-") for path in report["mapped"])
    assert list(shared_dir.iterdir()) == []


def test_a_rank_peers_cannot_open_through_proc_sends_the_group_to_files(shared_dir):
    for report in run_rank_processes([str(shared_dir)] * 2, undumpable=frozenset({1})):
        assert report.get("mean") == [0.5] * 5, report
        assert len(report["mapped"]) == 3, report
        assert all(path.startswith(f"{shared_dir}/ddprun-") for path in report["mapped"]), report
    assert list(shared_dir.iterdir()) == []  # unlinked once both ranks had opened them


def test_every_rank_falls_back_alike_when_a_rank_cannot_set_up_files(shared_dir):
    reports = run_rank_processes([str(shared_dir), str(shared_dir / "missing")], undumpable=frozenset({1}))
    assert reports[0] == reports[1], reports
    assert "rank 1 could not set up shared memory" in reports[0]["error"] and "missing" in reports[0]["error"]
    assert list(shared_dir.iterdir()) == []  # rank 0's files are removed too


def fork_rank(rank: int, world_size: int, *, connection: Connection, others: list, directory: Path) -> int:
    """A rank in a forked child (torch is already imported): set up, report through the relay, wait."""
    pid = os.fork()
    if pid:
        return pid
    try:
        for other in others:
            other.close()

        def exchange(value):
            connection.send(value)
            return connection.recv()

        ShmAllreduce.create(rank=rank, world_size=world_size, capacity=1 << 20, exchange=exchange, timeout_s=20,
                            directory=str(directory))
        exchange("set up")
        exchange("waiting to be killed")
    finally:
        os._exit(0)


def start_group(world_size: int, directory: Path) -> tuple[list[int], list[list]]:
    """Forked ranks, and the values of each round the relay completed."""
    ends = [tuple(Connection(end.detach()) for end in socket.socketpair()) for _ in range(world_size)]
    pids = [fork_rank(rank, world_size, connection=theirs, directory=directory,
                      others=[end for pair in ends for end in pair if end is not theirs])
            for rank, (_, theirs) in enumerate(ends)]
    for _, theirs in ends:
        theirs.close()
    gathered: list[list] = []
    relay([ours for ours, _ in ends], gathered)
    return pids, gathered


def is_set_up(gathered: list[list]) -> bool:
    return any(values[0] == "set up" for values in list(gathered))


def wait(condition: Callable[[], bool], *, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.0001)


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        os.waitpid(pid, 0)


def test_kill_9_at_any_moment_of_setup_leaves_nothing_behind(tmp_path):
    """Ranks killed at random points of their setup, one rank (the others a moment later, as torchrun
    stops them) or all at once (the launcher's death): no ddprun-* entry in /dev/shm nor in the
    fallback's directory afterwards. Named files fail this in several of the 30 tries."""
    before, rng = shm_entries(), random.Random(1234)
    started = time.monotonic()
    pids, gathered = start_group(2, tmp_path)
    wait(lambda: is_set_up(gathered))
    setup_s = time.monotonic() - started  # mostly forking and starting up, before the first round
    kill_all(pids)
    interrupted = 0
    for _ in range(30):
        world_size, rounds = rng.choice([2, 3]), rng.choice([0, 1, 2])  # kill after that many exchanges
        pids, gathered = start_group(world_size, tmp_path)
        wait(lambda: len(gathered) >= rounds or is_set_up(gathered))
        time.sleep(rng.uniform(0, setup_s if rounds == 0 else 0.002))
        for pid in rng.sample(pids, rng.choice([1, world_size])):
            os.kill(pid, signal.SIGKILL)
        interrupted += not is_set_up(gathered)
        time.sleep(rng.uniform(0, 0.002))  # the others run on until they are stopped
        kill_all(pids)
    assert shm_entries() - before == set() and list(tmp_path.iterdir()) == []
    assert interrupted >= 5, f"only {interrupted} of 30 kills landed in a setup of {setup_s * 1e3:.1f} ms"
