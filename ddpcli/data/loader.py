"""Loader batches (`--data-path loader`): a DataLoader whose workers persist across epochs
decode (image folders), crop and flip each image; pinned memory, non-blocking copies,
normalisation on the device.
"""

from __future__ import annotations

import abc
import functools
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from ddpcli.data.augment import crop_and_flip_one, crop_box_one, resized_crop_one
from ddpcli.data.autoaugment import auto_augment_images
from ddpcli.data.decode import read_resized_crop, read_rgb, read_rgb_at_least
from ddpcli.data.layout import Augment, Sample, resize_side
from ddpcli.data.resharding import split_in_batches
from ddpcli.data.sets import ImageSet, centre_view_at
from ddpcli.errors import USAGE, DdpcliError, agreed_error
from ddpcli.process import (
    ROOM_FOR_TMPDIR,
    die_with,
    leave_job_signals_to_parent,
    multiprocessing_sockets_fit,
)


class KeyedImages(torch.utils.data.Dataset, abc.ABC):
    """The loader path's twin of DeviceResidentBatches. Items are keyed by (index, epoch): workers
    persist across epochs, so the epoch travels with each index instead of living in a
    copy of the dataset that the workers would never see change."""

    def __init__(
        self,
        seed: int,
        augment: Augment,
        image_size: int,
        crop_size: int | None = None,
        auto_augment: Any = None,
    ):
        """CROP_SIZE: the side of `rrc`'s crops (--train-crop-size), IMAGE_SIZE by default;
        AUTO_AUGMENT: a torchvision policy applied after the crop."""
        self.seed, self.augment, self.image_size = seed, augment, image_size
        self.crop_size = crop_size or image_size
        self.auto_augment = auto_augment

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many images the split holds."""

    @abc.abstractmethod
    def load(self, index: int) -> tuple[torch.Tensor, int]:
        """uint8 (3, H, W) as held or decoded, and the label."""

    def centred(self, index: int) -> tuple[torch.Tensor, int]:
        """The image at the training size without augmentation (validation's view)."""
        return self.load(index)

    def resized_crop(self, index: int, key: int, epoch: int) -> tuple[torch.Tensor, int]:
        """The random-resized crop of image INDEX drawn for KEY, cut from the image as
        stored, not from a centre view."""
        image, label = self.load(index)
        return resized_crop_one(image, key, self.seed, epoch, self.crop_size), label

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        """KEY: (sample key, epoch); the key names the image `key % len(self)` and keys its
        draws (ddpcli.data.ra_sampler: copies of one image are augmented differently)."""
        sample_key, epoch = key
        index = sample_key % len(self)
        if self.augment == "rrc":
            image, label = self.resized_crop(index, sample_key, epoch)
        else:
            image, label = self.centred(index)
            if self.augment == "crop-flip":
                image = crop_and_flip_one(image, sample_key, self.seed, epoch)
        if self.auto_augment is not None:
            keys = torch.tensor([sample_key])
            image = auto_augment_images(image[None], keys, self.seed, epoch, self.auto_augment)[0]
        return image, label


class MemoryDataset(KeyedImages):
    """An in-memory ImageSet served through the DataLoader (`--data-path loader`)."""

    def __init__(self, image_set: ImageSet, seed: int, augment: Augment, **recipe: Any):
        super().__init__(seed, augment, image_set.images.shape[-1], **recipe)
        self.image_set = image_set

    def __len__(self) -> int:
        return len(self.image_set)

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        return self.image_set.images[index], int(self.image_set.labels[index])


class FolderDataset(KeyedImages):
    """ImageNet-layout images, decoded and resized per item in DataLoader workers, each
    JPEG at the smallest scale its view needs (ddpcli.data.decode). An image that cannot
    be decoded ends the run with UnreadableImage, naming it (--skip-bad-images leaves such
    files out of `samples` before training: ddpcli.data.sets.drop_unreadable)."""

    def __init__(
        self,
        samples: list[Sample],
        image_size: int,
        seed: int,
        augment: Augment,
        view: tuple[int, int] | None = None,
        **recipe: Any,
    ):
        """VIEW: (resize, crop) of the centred view, validation's (--val-resize-size,
        --val-crop-size); by default the training view's at IMAGE_SIZE."""
        super().__init__(seed, augment, image_size, **recipe)
        self.samples = samples
        self.view = view or (resize_side(image_size), image_size)

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return read_rgb(path), label

    def centred(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        resize, crop = self.view
        return centre_view_at(read_rgb_at_least(path, resize), resize, crop), label

    def resized_crop(self, index: int, key: int, epoch: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        box_for = functools.partial(crop_box_one, key, self.seed, epoch)
        return read_resized_crop(path, box_for, self.crop_size), label


class ShardBatches(torch.utils.data.Sampler):
    """This rank's batches for one epoch, as lists of (index, epoch) keys. It lives in the
    main process, so a persistent DataLoader picks up the new shard at each `iter()`; the
    batches' lengths come with the shard (a re-dealt epoch's last one is longer)."""

    def __init__(self):
        self.indices: list[int] = []
        self.batch_sizes: list[int] = []
        self.epoch = 0

    def set_shard(self, indices: list[int], epoch: int, batch_sizes: list[int]) -> None:
        self.indices, self.epoch, self.batch_sizes = list(indices), epoch, list(batch_sizes)

    def __iter__(self):
        epoch, end = self.epoch, 0
        batches = []
        for length in self.batch_sizes:
            start, end = end, end + length
            batches.append([(index, epoch) for index in self.indices[start:end]])
        return iter(batches)

    def __len__(self) -> int:
        return len(self.batch_sizes)


class LoaderBatches:
    """One DataLoader for the whole run: workers start once and persist across epochs,
    pinned memory, prefetching and non-blocking copies; normalisation on the device.
    `drop_last` (training) leaves out a shard's last, partial batch, unless the epoch
    names its batches' lengths (for_epoch)."""

    def __init__(
        self, dataset, batch_size, device, mean, std, workers, channels_last, drop_last,
        persistent=True, stage=None, collate_fn=None,
    ):  # fmt: skip
        """STAGE: what turns the workers' batches into the device's (ddpcli.data.encoded's
        DecodeOnDevice with its COLLATE_FN); by default the pixels normalised there."""
        if workers and not multiprocessing_sockets_fit():
            raise tmpdir_too_long()
        self.batches = ShardBatches()
        self.batch_size, self.drop_last = batch_size, drop_last
        self.loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=self.batches,
            num_workers=workers,
            collate_fn=collate_fn,
            pin_memory=device.type == "cuda",
            persistent_workers=persistent and workers > 0,
            prefetch_factor=4 if workers else None,
            worker_init_fn=functools.partial(die_with_rank, os.getpid()),
        )
        self.stage = stage or Normalise(device, mean, std, channels_last)

    def for_epoch(
        self, indices: list[int], epoch: int, batch_sizes: list[int] | None = None
    ) -> LoaderBatches:
        if batch_sizes is None:
            batch_sizes = split_in_batches(len(indices), self.batch_size, self.drop_last)
        self.batches.set_shard(indices, epoch, batch_sizes)
        return self

    def __len__(self) -> int:
        return len(self.loader)

    def close(self) -> None:
        """End the persistent workers now, not at interpreter exit: a GPU run (pinned
        memory) stopped mid-epoch by --max-steps sat 80 s after its last line before its
        process ended (measured on an H100; pytorch#81794 reports 5 s per worker at exit).
        Lightning ends its loaders' workers the same way at the end of fit."""
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        self.loader._iterator = None

    def __iter__(self):
        for images, labels in self.loader:
            yield self.stage(images, labels)


# What the rank makes of its workers' batches (pixels or encoded, labels) on its device:
# the pixels normalised (Normalise), or --decode gpu's DecodeOnDevice (ddpcli.data.encoded).
Stage = Callable[[Any, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Normalise:
    """uint8 batches onto the device, normalised there: the stage between the loader workers
    and the step where the workers decode (--decode cpu)."""

    def __init__(self, device: torch.device, mean, std, channels_last: bool) -> None:
        self.device = device
        self.mean = torch.tensor(mean, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(std, device=device).view(1, 3, 1, 1)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        images = images.to(self.device, non_blocking=True)
        images = (images.float().div_(255) - self.mean) / self.std
        return (
            images.contiguous(memory_format=self.memory_format),
            labels.to(self.device, non_blocking=True),
        )


def tmpdir_too_long() -> DdpcliError:
    """Else the workers' first batch never arrives: their socket cannot be made, and the
    rank waits for it for good (every rank alike)."""
    folder = tempfile.gettempdir()
    return agreed_error(
        f"TMPDIR {folder} is too long ({len(os.fsencode(folder))} bytes): DataLoader workers "
        f"hand batches over through UNIX sockets made in it, which leave it {ROOM_FOR_TMPDIR} "
        "bytes; set TMPDIR to a shorter folder (export TMPDIR=/tmp) or pass --workers 0",
        USAGE,
    )


def die_with_rank(rank_pid: int, worker_id: int) -> None:
    """A loader worker, forked after the process group formed, holds its rank's Gloo
    sockets: alive after its rank is killed, it keeps them open, so the peers wait in a
    collective until the worker's own check of its parent (every 5 s) ends it, instead of
    failing at once. It dies with its rank, and leaves a job's signals to it: one that killed
    it (torch's own handler dies of a SIGTERM its rank did not send) failed the rank that was
    about to save a preemption checkpoint."""
    die_with(rank_pid)
    leave_job_signals_to_parent()


def default_workers(local_world_size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0, min(8, (cores or 1) // max(1, local_world_size) - 1))
