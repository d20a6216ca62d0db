"""Where batches come from: a synthetic pool on the device, FakeData, or an ImageFolder tree.

Every training source shards with a `DistributedSampler` (seeded by --seed, `set_epoch`
each epoch), so N processes at batch B see, step for step, the samples one process
sees at batch N*B. Sources can skip the first batches of an epoch, so a run resumed
mid-epoch continues with the next batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from ddprun.train_options import TrainOptions, image_folder_roots

Batch = tuple[torch.Tensor, torch.Tensor]

POOL_LIMIT = 256  # synthetic samples actually held in memory; indices wrap around the pool
_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Placement:
    """Where tensors go: the training device and memory format."""

    device: torch.device
    channels_last: bool

    def images(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device, non_blocking=True)
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x


class SyntheticSource:
    """A fixed pool of random images made once on the device; an epoch gathers from it by sampler index."""

    def __init__(self, *, size: int, image_size: int, num_classes: int, batch_size: int, seed: int,
                 rank: int, world_size: int, placement: Placement) -> None:
        generator = torch.Generator().manual_seed(seed)
        pool = min(size, POOL_LIMIT)
        self._images = placement.images(torch.randn(pool, 3, image_size, image_size, generator=generator))
        self._labels = torch.randint(0, num_classes, (pool,), generator=generator).to(placement.device)
        self._sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        self._batch_size = batch_size
        self._device = placement.device
        self.batches_per_epoch = len(self._sampler) // batch_size

    def batches(self, epoch: int, *, skip: int = 0) -> Iterator[Batch]:
        self._sampler.set_epoch(epoch)
        # One host-to-device copy per epoch; per-step copies from pageable memory would sync the stream.
        order = torch.tensor(list(self._sampler), dtype=torch.long).remainder_(len(self._labels))
        order = order.to(self._device)
        for start in range(skip * self._batch_size, self.batches_per_epoch * self._batch_size, self._batch_size):
            index = order[start:start + self._batch_size]
            yield self._images.index_select(0, index), self._labels.index_select(0, index)


class _SkippingSampler(Sampler[int]):
    """A DistributedSampler whose first `skip` indices of the epoch are left out (mid-epoch resume)."""

    def __init__(self, inner: DistributedSampler) -> None:
        self.inner = inner
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        indices = iter(self.inner)
        for _ in range(self.skip):
            next(indices)
        return indices

    def __len__(self) -> int:
        return len(self.inner) - self.skip


class LoaderSource:
    """A map-style dataset read through a DataLoader, sharded with a DistributedSampler."""

    def __init__(self, dataset, *, opts: TrainOptions, rank: int, world_size: int, placement: Placement) -> None:
        inner = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=opts.seed)
        self._sampler = _SkippingSampler(inner)
        self._loader = _loader(dataset, sampler=self._sampler, opts=opts, placement=placement, drop_last=True)
        self._batch_size = opts.batch_size
        self._placement = placement
        self.batches_per_epoch = len(inner) // opts.batch_size

    def batches(self, epoch: int, *, skip: int = 0) -> Iterator[Batch]:
        self._sampler.inner.set_epoch(epoch)
        self._sampler.skip = skip * self._batch_size
        for images, labels in self._loader:
            yield self._placement.images(images), labels.to(self._placement.device, non_blocking=True)


class ValSource:
    """Validation shards without padding (rank r takes r, r+N, ...), so all-reduced counts are exact."""

    def __init__(self, dataset, *, opts: TrainOptions, rank: int, world_size: int, placement: Placement) -> None:
        shard = list(range(rank, len(dataset), world_size))
        self._loader = _loader(dataset, sampler=shard, opts=opts, placement=placement, drop_last=False)
        self._placement = placement
        self.size = len(dataset)

    def batches(self) -> Iterator[Batch]:
        for images, labels in self._loader:
            yield self._placement.images(images), labels.to(self._placement.device, non_blocking=True)


def _loader(dataset, *, sampler, opts: TrainOptions, placement: Placement, drop_last: bool) -> DataLoader:
    on_cuda = placement.device.type == "cuda"
    return DataLoader(
        dataset, batch_size=opts.batch_size, sampler=sampler, num_workers=opts.workers, drop_last=drop_last,
        pin_memory=on_cuda, persistent_workers=on_cuda and opts.workers > 0,
    )


@dataclass
class TrainData:
    train: object  # SyntheticSource | LoaderSource
    val: Optional[ValSource]
    num_classes: int


def build_data(opts: TrainOptions, *, rank: int, world_size: int, placement: Placement) -> TrainData:
    shard = {"rank": rank, "world_size": world_size, "placement": placement}
    if opts.data == "synthetic":
        num_classes = opts.num_classes or 1000
        source = SyntheticSource(size=opts.dataset_size, image_size=opts.image_size, num_classes=num_classes,
                                 batch_size=opts.batch_size, seed=opts.seed, **shard)
        return TrainData(train=source, val=None, num_classes=num_classes)
    import torchvision

    if opts.data == "fake":
        num_classes = opts.num_classes or 1000
        dataset = torchvision.datasets.FakeData(
            size=opts.dataset_size, image_size=(3, opts.image_size, opts.image_size), num_classes=num_classes,
            transform=torchvision.transforms.ToTensor(), random_offset=opts.seed,
        )
        return TrainData(train=LoaderSource(dataset, opts=opts, **shard), val=None, num_classes=num_classes)
    train_root, val_root = image_folder_roots(opts.data)
    train_set = torchvision.datasets.ImageFolder(train_root, transform=_transform(opts.image_size, flip=opts.hflip))
    val = None
    if val_root is not None:
        val_set = torchvision.datasets.ImageFolder(val_root, transform=_transform(opts.image_size, flip=False))
        val = ValSource(val_set, opts=opts, **shard)
    return TrainData(train=LoaderSource(train_set, opts=opts, **shard), val=val, num_classes=len(train_set.classes))


def _transform(image_size: int, *, flip: bool):
    """Resize and centre-crop; training images are also flipped at random unless --no-hflip (the reference
    recipe flips; digits, text or road signs are not mirror-symmetric and learn better without it)."""
    from torchvision import transforms

    steps = [transforms.Resize(image_size), transforms.CenterCrop(image_size)]
    if flip:
        steps.append(transforms.RandomHorizontalFlip())
    steps += [transforms.ToTensor(), transforms.Normalize(_MEAN, _STD)]
    return transforms.Compose(steps)
