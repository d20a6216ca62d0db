"""The shared-memory all-reduce, with ranks as threads of this process (the files and FIFOs are real)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import pytest
import torch

from ddprun.worker.shm_allreduce import (
    ALIGN, SharedMemoryUnavailable, ShmAllreduce, capacity_for, shm_allreduce_hook,
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


def test_files_are_gone_once_every_rank_has_mapped_them(tmp_path):
    def work(rank, exchange):
        shm = create(rank, exchange, world_size=2, directory=tmp_path)
        exchange(None)  # both ranks are set up
        listing = sorted(p.name for p in tmp_path.iterdir())
        exchange(None)  # both ranks have listed
        shm.close()
        return listing

    assert on_ranks(2, work) == [[], []]


def test_every_rank_falls_back_alike_when_a_rank_cannot_set_up(tmp_path):
    def work(rank, exchange):
        return create(rank, exchange, world_size=2, directory=tmp_path if rank == 0 else tmp_path / "missing")

    errors = on_ranks(2, work)
    assert all(isinstance(error, SharedMemoryUnavailable) for error in errors), errors
    assert str(errors[0]) == str(errors[1])
    assert "rank 1 could not set up shared memory" in str(errors[0]) and "missing" in str(errors[0])
    assert list(tmp_path.iterdir()) == []  # rank 0's files are removed too


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
