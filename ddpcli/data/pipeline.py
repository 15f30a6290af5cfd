"""What the training loop sees: this rank's train and validation batches, whichever path
they come from. Training is sharded exactly as DistributedSampler shards it (`set_epoch`
each epoch), in full batches only: a shard's last, partial batch is left out (as timm
does), so no step runs on a handful of images and BatchNorm always sees a batch; the
order changes every epoch, so no image is always the one left out. The rest of an epoch
re-dealt at a new world is the exception: its tail is folded into each rank's last batch
(ddpcli.data.resharding). Validation is strided and unpadded, so every sample is counted
exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, cast

import torch
from torch.utils.data import DistributedSampler

from ddpcli.config import TrainConfig
from ddpcli.data.autoaugment import policy_transform
from ddpcli.data.custom import CustomDataset, CustomSplits
from ddpcli.data.device import DeviceResidentBatches
from ddpcli.data.erasing import ErasedBatches
from ddpcli.data.layout import Augment, resize_side, training_augment
from ddpcli.data.loader import (
    FolderDataset,
    KeyedImages,
    LoaderBatches,
    MemoryDataset,
    default_workers,
)
from ddpcli.data.ra_sampler import repeated_shard
from ddpcli.data.resharding import (
    LEAST_BATCH,
    epoch_order,
    left_out,
    remaining_batch_sizes,
    remaining_shard,
    remaining_steps,
    split_in_batches,
)
from ddpcli.data.sets import (
    FolderSplits,
    ImageSet,
    MemorySplits,
    ShardSplits,
    Splits,
    view_set,
)
from ddpcli.data.shards.feed import MemberImages, Normalise, ShardFeed
from ddpcli.dist import DistContext
from ddpcli.errors import USAGE, agreed_error

# Image folders are normalised with ImageNet's statistics on both paths (as torchvision's
# reference recipes do); the in-memory sets with their own, measured on the training split.
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def train_shard(size: int, ctx: DistContext, seed: int, epoch: int) -> list[int]:
    """This rank's training indices for the epoch: exactly what DistributedSampler yields.
    It pads so every rank gets the same count (and the same number of steps)."""
    # DistributedSampler only takes len() of its dataset; the stubs ask for a Dataset.
    sampler: DistributedSampler[int] = DistributedSampler(
        range(size),  # type: ignore[arg-type]
        num_replicas=ctx.world_size,
        rank=ctx.rank,
        shuffle=True,
        seed=seed,
    )
    sampler.set_epoch(epoch)  # without it every epoch repeats the same order
    return list(sampler)


def val_shard(size: int, ctx: DistContext) -> list[int]:
    """Strided, unpadded: each validation sample on exactly one rank."""
    return list(range(ctx.rank, size, ctx.world_size))


def channel_stats(images: torch.Tensor) -> tuple[list[float], list[float]]:
    sample = images[:: max(1, len(images) // 1000)].float() / 255
    mean = sample.mean(dim=(0, 2, 3))
    std = sample.std(dim=(0, 2, 3)).clamp_min(1e-3)
    return mean.tolist(), std.tolist()


class TracedBatches:
    """Batches that append each batch's sample indices to a file as they are handed out
    (DDPCLI_TRACE_SAMPLES): a record of exactly what this rank trained on. INDICES: the
    epoch's keys for this rank in batch order; each batch takes as many as it has labels.
    Each record names the world it was trained in: where an elastic job's rounds change the
    world, it tells their records apart (a rank's file holds every round's)."""

    def __init__(self, batches, indices: list[int], path: Path, epoch: int, world: int):
        self.batches, self.indices = batches, indices
        self.path, self.epoch, self.world = path, epoch, world

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        end = 0
        with open(self.path, "a") as handle:
            for batch in self.batches:
                start, end = end, end + len(batch[1])
                chunk = self.indices[start:end]
                record = {"epoch": self.epoch, "world": self.world, "indices": chunk}
                handle.write(json.dumps(record) + "\n")
                handle.flush()
                yield batch


class SlowedBatches:
    """Batches handed out SECONDS late each (DDPCLI_SLOW_DATA): a straggler on purpose."""

    def __init__(self, batches, seconds: float):
        self.batches, self.seconds = batches, seconds

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            time.sleep(self.seconds)
            yield batch


def on_device(image_set: ImageSet, device: torch.device) -> ImageSet:
    """The set's images and labels on `device`; its decoded sizes stay where crops are drawn."""
    images, labels = image_set.images.to(device), image_set.labels.to(device)
    return dataclasses.replace(image_set, images=images, labels=labels)


class DataPipeline:
    """Train and validation batches for this rank, whichever path they come from."""

    def __init__(
        self,
        splits: Splits | CustomSplits,
        cfg: TrainConfig,
        ctx: DistContext,
        device_resident: bool,
    ):
        self.splits = splits
        self.cfg = cfg
        self.ctx = ctx
        self.channels_last = ctx.device.type == "cuda"
        self.augment = training_augment(cfg.augment, cfg.dataset)
        self.auto_augment = policy_transform(cfg.auto_augment)
        self.crop_size = cfg.resolved_train_crop_size
        if isinstance(splits, MemorySplits) and cfg.dataset != "imagefolder":
            crop = cfg.resolved_val_crop_size
            splits.val = view_set(splits.val, cfg.val_resize_size or crop, crop)
        # Only a set held in memory can be moved onto the device; a streamed folder cannot.
        self.device_resident = device_resident and isinstance(splits, MemorySplits)
        if isinstance(splits, MemorySplits) and cfg.dataset != "imagefolder":
            self.mean, self.std = channel_stats(splits.train.images)
        else:  # image folders, streamed or decoded once, and the user's own sets
            self.mean, self.std = IMAGENET_MEAN, IMAGENET_STD
        self.workers = (
            cfg.workers if cfg.workers is not None else default_workers(ctx.local_world_size)
        )
        trace = cfg.trace_samples
        self.trace_file = trace.with_name(f"{trace.name}.rank{ctx.rank}") if trace else None
        self.shards: ShardFeed | None = None
        self.loaders: list[LoaderBatches] = []  # what close() ends
        if isinstance(splits, ShardSplits):
            self._stream_shards(splits)
        elif isinstance(splits, FolderSplits):
            self._stream_folders(splits)
        elif isinstance(splits, CustomSplits):
            self._stream_custom(splits)
        elif self.device_resident:
            self._hold_on_device(splits)
        else:
            self._start_loaders(
                MemoryDataset(splits.train, cfg.seed, self.augment, **self.recipe()),
                MemoryDataset(splits.val, cfg.seed, "none"),
            )
        self._check_one_batch()

    def _hold_on_device(self, splits: MemorySplits) -> None:
        # The uint8 set lives where it is augmented; batches never cross PCIe. The splits
        # then hold the device copies only: a host copy kept beside them would hold the
        # whole set in host memory for nothing, per rank.
        splits.train = self.train_set = on_device(splits.train, self.ctx.device)
        splits.val = self.val_set = on_device(splits.val, self.ctx.device)
        self.train_size, self.val_size = len(splits.train), len(splits.val)

    def recipe(self) -> dict:
        """The training set's share of the recipe: its crop side and policy."""
        return {"crop_size": self.crop_size, "auto_augment": self.auto_augment}

    def _stream_folders(self, splits: FolderSplits) -> None:
        cfg = self.cfg
        size, seed, crop = cfg.resolved_image_size, cfg.seed, cfg.resolved_val_crop_size
        view = (cfg.val_resize_size or resize_side(crop), crop)
        self._start_loaders(
            FolderDataset(splits.train_samples, size, seed, self.augment, **self.recipe()),
            FolderDataset(splits.val_samples, size, seed, "none", view=view),
        )

    def _stream_shards(self, splits: ShardSplits) -> None:
        """Shards: each rank's loader workers stream their parts of the epoch
        (ddpcli.data.shards.feed); decoding and augmentation as for image folders."""
        cfg = self.cfg
        size, seed, crop = cfg.resolved_image_size, cfg.seed, cfg.resolved_val_crop_size
        view = (cfg.val_resize_size or resize_side(crop), crop)
        normalise = Normalise(self.ctx.device, self.mean, self.std, self.channels_last)
        self.shards = ShardFeed(
            splits, cfg, self.ctx, self.workers, normalise,
            MemberImages(size, seed, self.augment, **self.recipe()),
            MemberImages(size, seed, "none", view=view),
        )  # fmt: skip
        self.train_size, self.val_size = self.shards.train_size, self.shards.val_size

    def _stream_custom(self, splits: CustomSplits) -> None:
        cfg = self.cfg
        size, classes = cfg.resolved_image_size, splits.num_classes
        self._start_loaders(
            CustomDataset(
                splits.train, "train", cfg.dataset, classes, size, cfg.seed, self.augment
            ),
            CustomDataset(splits.val, "val", cfg.dataset, classes, size, cfg.seed, "none"),
        )

    def _start_loaders(self, train: KeyedImages, val: KeyedImages) -> None:
        self.train_size, self.val_size = len(train), len(val)
        self.train_loader = self._loader(train, drop_last=True)
        self.val_loader = self._loader(val, drop_last=False)
        self.loaders = [self.train_loader, self.val_loader]

    def close(self) -> None:
        """End the loader workers before the process ends (LoaderBatches.close says why)."""
        for loader in self.loaders:
            loader.close()

    def _loader(self, dataset: KeyedImages, drop_last: bool) -> LoaderBatches:
        return LoaderBatches(
            dataset, self.cfg.per_gpu_batch, self.ctx.device, self.mean, self.std, self.workers,
            self.channels_last, drop_last,
        )  # fmt: skip

    def _check_one_batch(self) -> None:
        """Full batches only: each rank's share of the train split must fill one."""
        if self.steps_per_epoch() == 0 and self.shards is not None:
            raise agreed_error(
                f"the shards' {self.train_size} train samples over {self.ctx.world_size} "
                f"rank(s) give some rank fewer than {LEAST_BATCH}, the least a training batch "
                "holds; pack more samples or run fewer ranks",
                USAGE,
            )
        if self.steps_per_epoch() == 0:
            world, batch = self.ctx.world_size, self.cfg.per_gpu_batch
            raise agreed_error(
                f"invalid --per-gpu-batch: {self.train_size} train images over {world} "
                f"rank(s) give each {self.shard_size()}, less than one batch of {batch}; "
                f"lower --per-gpu-batch to {self.shard_size()} or less",
                USAGE,
            )

    @property
    def path_name(self) -> str:
        if self.shards is not None:
            return f"shards ({self.workers} workers)"
        return "device" if self.device_resident else f"loader ({self.workers} workers)"

    def shard_size(self) -> int:
        """Each rank's training images per epoch, before batching (DistributedSampler pads)."""
        return math.ceil(self.train_size / self.ctx.world_size)

    def steps_per_epoch(self, start: int = 0) -> int:
        """Full batches per rank and epoch: what train_batches yields. START > 0: the rest of
        an epoch re-dealt from that global sample offset (ddpcli.data.resharding)."""
        if self.shards is not None:
            return self.shards.steps(start)
        if start:
            return remaining_steps(
                self.train_size, start, self.ctx.world_size, self.cfg.per_gpu_batch
            )
        return self.shard_size() // self.cfg.per_gpu_batch

    def images_per_epoch(self) -> int:
        if self.shards is not None:  # every sample, the tail folded into the last batches
            return self.train_size
        return self.steps_per_epoch() * self.cfg.per_gpu_batch * self.ctx.world_size

    def describe_sizes(self) -> str:
        """`4096 of 4097 train images per epoch (last partial batch dropped) / 1025 val images
        · 10 classes`: a stray folder taken for a class shows in the count."""
        if self.shards is not None:
            return (
                f"{self.shards.describe_sizes()} / {self.val_size} val samples · "
                f"{self.splits.num_classes} classes"
            )
        trained, size = self.images_per_epoch(), self.train_size
        if trained < size:
            train = f"{trained} of {size} train images per epoch (last partial batch dropped)"
        elif trained > size:  # DistributedSampler repeats a few to give each rank as many
            repeated = f"{trained - size} repeated to even out the ranks"
            train = f"{size} train images, {trained} per epoch ({repeated})"
        else:
            train = f"{size} train images per epoch"
        if self.cfg.ra_reps > 1:  # the epoch keeps its length: fewer images, repeated
            reps = self.cfg.ra_reps
            train += f" (--ra-reps {reps}: about {trained // reps} distinct, each on {reps} ranks)"
        return f"{train} / {self.val_size} val images · {self.splits.num_classes} classes"

    def describe_rest(self, epoch: int, start: int) -> str:
        """`epoch 1: 36 of 96 samples trained before the resume; the other 60 dealt over 2
        ranks, 7 batches of 4 each, the last of them 6 (the tail folded in)`."""
        if self.shards is not None:
            return self.shards.describe_rest(epoch, start)
        world, batch, size = self.ctx.world_size, self.cfg.per_gpu_batch, self.train_size
        head = (
            f"epoch {epoch + 1}: {start} of {size} samples trained before the resume; the other "
            f"{size - start}"
        )
        if left_out(size, start, world, batch):
            return (
                f"{head} left out (too few for a batch of {min(batch, LEAST_BATCH)} on each of "
                f"{world} ranks, the least a training batch holds)"
            )
        last_sizes = sorted(
            {remaining_batch_sizes(size, start, world, rank, batch)[-1] for rank in range(world)}
        )
        last = " or ".join(map(str, last_sizes))
        steps = self.steps_per_epoch(start)
        if steps == 1:
            return f"{head} dealt over {world} ranks, one batch of {last} each"
        line = f"{head} dealt over {world} ranks, {steps} batches of {batch} each"
        if last_sizes != [batch]:
            line += f", the last of them {last} (the tail folded in)"
        return line

    def train_batches(self, epoch: int, skip_batches: int = 0, start: int = 0):
        """The epoch's order depends only on seed and epoch; a resume skips by position, or
        (START > 0) deals the rest of the order from that global sample offset."""
        if self.shards is not None:  # a resume deals the rest anew: never skips batches
            shard_batches = self.shards.train_batches(epoch, start)
            return self._wrapped(shard_batches, cast(list[int], shard_batches.keys), epoch)
        keys = self.epoch_keys(epoch, start)
        sizes = self.train_batch_sizes(len(keys), start)
        indices, sizes = keys[sum(sizes[:skip_batches]) :], sizes[skip_batches:]
        if self.device_resident:
            batches = self._device_batches(
                self.train_set, indices, self.augment, epoch, True, self.auto_augment, sizes
            )
        else:
            batches = self.train_loader.for_epoch(indices, epoch, sizes)
        return self._wrapped(batches, indices, epoch)

    def _wrapped(self, batches: Any, indices: list[int], epoch: int) -> Any:
        """Random erasing, the sample trace and the slowed rank, as asked; INDICES: the keys
        of the epoch's batches, in order (for shards, read as each batch is handed out)."""
        if self.cfg.random_erase > 0:
            batches = ErasedBatches(batches, indices, self.cfg.seed, epoch, self.cfg.random_erase)
        if self.trace_file:
            world = self.ctx.world_size
            batches = TracedBatches(batches, indices, self.trace_file, epoch, world)
        slow = self.cfg.slow_data
        if slow is not None and slow[0] == self.ctx.rank:
            batches = SlowedBatches(batches, slow[1])
        return batches

    def train_batch_sizes(self, keys: int, start: int) -> list[int]:
        """The lengths of this rank's micro-batches of its KEYS for the epoch: full batches,
        the last partial one dropped; or (START > 0) the re-dealt rest's, the tail folded
        into the last (ddpcli.data.resharding)."""
        batch = self.cfg.per_gpu_batch
        if start:
            world, rank = self.ctx.world_size, self.ctx.rank
            return remaining_batch_sizes(self.train_size, start, world, rank, batch)
        return split_in_batches(keys, batch, drop_last=True)

    def epoch_keys(self, epoch: int, start: int = 0) -> list[int]:
        """This rank's sample keys for EPOCH: DistributedSampler's shard, or with --ra-reps
        the repeated-augmentation one (keys beyond the set name further copies); from START
        on, this rank's share of the rest of the same order."""
        cfg, ctx = self.cfg, self.ctx
        if start:
            order = epoch_order(self.train_size, cfg.seed, epoch, cfg.ra_reps)
            return remaining_shard(order, start, ctx.world_size, ctx.rank, cfg.per_gpu_batch)
        if cfg.ra_reps > 1:
            return repeated_shard(
                self.train_size, ctx.world_size, ctx.rank, cfg.seed, epoch, cfg.ra_reps
            )
        return train_shard(self.train_size, ctx, cfg.seed, epoch)

    def val_batches(self):
        if self.shards is not None:
            return self.shards.val_batches()
        indices = val_shard(self.val_size, self.ctx)
        if self.device_resident:
            return self._device_batches(self.val_set, indices, "none", 0, drop_last=False)
        return self.val_loader.for_epoch(indices, 0)

    # --- where a shards epoch stands (None and no-ops on the other paths)
    def stream_position(self, batch_in_epoch: int, epoch_start: int) -> dict[str, Any] | None:
        """For a checkpoint: the shard streams' pieces not yet trained (a collective on every
        rank); None on the other paths, whose position is the sample offset alone."""
        if self.shards is None:
            return None
        return self.shards.position(batch_in_epoch, epoch_start)

    def follow_position(self, position: dict[str, Any] | None) -> None:
        """A resume's stream position (shards): the rest of its epoch is dealt from it."""
        if self.shards is not None:
            self.shards.follow(position)

    def stream_line(self) -> str:
        """The header's line on how shards are read; "" on the other paths."""
        return self.shards.stream_line() if self.shards is not None else ""

    def _device_batches(
        self,
        image_set: ImageSet,
        indices,
        augment: Augment,
        epoch: int,
        drop_last: bool,
        auto_augment=None,
        batch_sizes: list[int] | None = None,
    ):
        return DeviceResidentBatches(
            image_set, indices, self.cfg.per_gpu_batch, self.ctx.device, self.mean, self.std,
            augment, self.cfg.seed, epoch, self.channels_last, drop_last, self.crop_size,
            auto_augment, batch_sizes,
        )  # fmt: skip
