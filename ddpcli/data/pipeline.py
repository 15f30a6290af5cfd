"""What the training loop sees: this rank's train and validation batches, whichever path
they come from. Training is sharded exactly as DistributedSampler shards it (`set_epoch`
each epoch), in full batches only: a shard's last, partial batch is left out (as timm
does), so no step runs on a handful of images and BatchNorm always sees a batch; the
order changes every epoch, so no image is always the one left out. The rest of an epoch
re-dealt at a new world is the exception: its tail is folded into each rank's last batch
(ddpcli.data.resharding). Validation is strided and unpadded, so every sample is counted
exactly once.

One interface, `DataPath`, with one implementation per path: `ShardPath` (--dataset shards,
streamed), `DevicePath` (--data-path device) and `LoaderPath` (a DataLoader); the last two
share DistributedSampler's arithmetic (`SampledPath`). Each owns its resume state
(`state_dict` / `load_state_dict`, as Mosaic Streaming's datasets do), so the loop and its
checkpoints never ask which kind of data they have. `DataPipeline` chooses the path.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, TypeGuard, cast

import torch
from torch.utils.data import DistributedSampler

from ddpcli.config.plan import RunPlan
from ddpcli.data.autoaugment import policy_transform
from ddpcli.data.custom import CustomDataset, CustomSplits
from ddpcli.data.device import DeviceResidentBatches
from ddpcli.data.encoded import (
    DecodeOnDevice,
    EncodedFiles,
    EncodedMembers,
    collate_encoded,
)
from ddpcli.data.erasing import ErasedBatches
from ddpcli.data.layout import Augment, training_augment
from ddpcli.data.loader import (
    FolderDataset,
    LoaderBatches,
    MemoryDataset,
    Normalise,
    Stage,
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
from ddpcli.data.shards.feed import MemberImages, ShardFeed
from ddpcli.dist import DistContext, all_reduce_sum
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


class DataPath(ABC):
    """What the training loop, its checkpoints and the header see of this rank's data,
    whichever path it comes from: its sizes, its batches, and its resume state. One subclass
    per path; `DataPipeline` picks which."""

    name = ""  # --data-path's word, shown with the loader workers where there are any
    device_resident = False  # the set lives on the device (--data-path device)

    def __init__(self, splits: Splits | CustomSplits, cfg: RunPlan, ctx: DistContext):
        self.splits, self.cfg, self.ctx = splits, cfg, ctx
        self.channels_last = ctx.device.type == "cuda"
        self.augment = training_augment(cfg.augment, cfg.dataset)
        self.auto_augment = policy_transform(cfg.auto_augment)
        self.crop_size = cfg.train_crop_size
        self.mean, self.std = normalisation(splits, cfg)
        self.workers = (
            cfg.workers if cfg.workers is not None else default_workers(ctx.local_world_size)
        )
        trace = cfg.trace_samples
        self.trace_file = trace.with_name(f"{trace.name}.rank{ctx.rank}") if trace else None
        self.train_size = self.val_size = 0  # each path sets them as it opens its sets
        # --decode gpu: the workers read bytes, the rank decodes (ddpcli.data.encoded); only
        # files and shards hold JPEGs (the plan settles it so: this is the guard).
        self.decodes_on_device = cfg.decode == "gpu" and isinstance(
            splits, (FolderSplits, ShardSplits)
        )
        self.train_stage, self.val_stage = self.stages()

    def stages(self) -> tuple[Stage, Stage]:
        """What the rank makes of its workers' batches, for training and for validation:
        pixels normalised on its device, or (--decode gpu) JPEGs decoded and viewed there."""
        ctx, cfg = self.ctx, self.cfg
        if not self.decodes_on_device:
            normalise = Normalise(ctx.device, self.mean, self.std, self.channels_last)
            return normalise, normalise
        common = (ctx.device, self.mean, self.std, self.channels_last)
        size = self.crop_size if self.augment == "rrc" else cfg.image_size
        train = DecodeOnDevice(
            *common, self.augment, size, cfg.seed, auto_augment=self.auto_augment
        )
        val = DecodeOnDevice(*common, "none", cfg.val_crop_size, cfg.seed, view=self.val_view())
        return train, val

    def decode_figures(self) -> dict[str, int]:
        """--decode gpu: images decoded on the CPU instead since the last call, the epoch's
        (nvjpeg's batches do not take them: PNG, CMYK, grey, progressive), over every rank:
        a collective, every rank calls it. {} else."""
        if not self.decodes_on_device:
            return {}
        stages = cast(list[DecodeOnDevice], [self.train_stage, self.val_stage])
        mine = float(sum(stage.decoded_on_cpu for stage in stages))
        for stage in stages:
            stage.decoded_on_cpu = 0
        total = all_reduce_sum(torch.tensor([mine], device=self.ctx.device), self.ctx)
        return {"decoded_on_cpu": int(total.item())}

    def decode_line(self) -> str:
        """The header's line on where JPEGs are decoded; "" where training reads none."""
        if not isinstance(self.splits, (FolderSplits, ShardSplits)):
            return ""
        reason = f" ({self.cfg.decode_reason})" if self.cfg.decode_reason else ""
        if not self.decodes_on_device:
            return (
                f"decode cpu{reason}: the loader workers decode each JPEG (libjpeg-turbo, at "
                "the scale its crop needs), crop and flip it"
            )
        stage = cast(DecodeOnDevice, self.train_stage)
        return (
            f"decode gpu{reason}: the loader workers read the bytes; {stage.describe()} "
            "decodes each batch, crops, flips and normalises it there; images it does not "
            "take (PNG, CMYK, grey, progressive) are decoded on the CPU, counted in "
            "metrics.jsonl's decoded_on_cpu"
        )

    def recipe(self) -> dict:
        """The training set's share of the recipe: its crop side and policy."""
        return {"crop_size": self.crop_size, "auto_augment": self.auto_augment}

    def val_view(self) -> tuple[int, int]:
        """Validation's (resize side, crop side) for sets decoded as they are read."""
        return self.cfg.val_resize_size, self.cfg.val_crop_size

    @property
    def path_name(self) -> str:
        return f"{self.name} ({self.workers} workers)"

    @abstractmethod
    def check_one_batch(self) -> None:
        """Full batches only: each rank's share of the train split must fill one."""

    @abstractmethod
    def steps_per_epoch(self, start: int = 0) -> int:
        """Full batches per rank and epoch: what train_batches yields. START > 0: the rest of
        an epoch re-dealt from that global sample offset (ddpcli.data.resharding)."""

    @abstractmethod
    def describe_sizes(self) -> str:
        """`4096 of 4097 train images per epoch (last partial batch dropped) / 1025 val images
        · 10 classes`: a stray folder taken for a class shows in the count."""

    @abstractmethod
    def describe_rest(self, epoch: int, start: int) -> str:
        """How a resume deals the rest of EPOCH from the global sample offset START."""

    @abstractmethod
    def train_batches(self, epoch: int, skip_batches: int = 0, start: int = 0) -> Any:
        """The epoch's order depends only on seed and epoch; a resume skips by position, or
        (START > 0) deals the rest of the order from that global sample offset."""

    @abstractmethod
    def val_batches(self) -> Any: ...

    # --- the resume state, beside the sample offset the TrainState holds
    def state_dict(self, batch_in_epoch: int, epoch_start: int) -> dict[str, Any] | None:
        """For a checkpoint's `stream_position` (every rank calls it: it may be a collective).
        None where the sample offset alone says where the epoch stands."""
        return None

    def load_state_dict(self, position: dict[str, Any] | None) -> None:
        """A resume's `stream_position`: where the rest of its epoch is dealt from."""
        return None  # the sample offset in the TrainState is all there is to follow

    def stream_line(self) -> str:
        """The header's line on how the data is streamed; "" where there is nothing to say."""
        return ""

    def close(self) -> None:
        """End the loader workers before the process ends (LoaderBatches.close says why)."""
        return None  # a path without workers has nothing to end

    def wrapped(self, batches: Any, indices: list[int], epoch: int) -> Any:
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


def normalisation(splits: Splits | CustomSplits, cfg: RunPlan) -> tuple[list, list]:
    """The mean and std batches are normalised with: the in-memory sets' own, measured on the
    training split; ImageNet's for image folders, streamed or decoded once, and a user's sets."""
    if holds_its_own_statistics(splits, cfg):
        return channel_stats(splits.train.images)
    return IMAGENET_MEAN, IMAGENET_STD


def holds_its_own_statistics(
    splits: Splits | CustomSplits, cfg: RunPlan
) -> TypeGuard[MemorySplits]:
    """An in-memory set of its own (synthetic, STL-10), not an image folder decoded once: its
    images are already at their side, and its mean and std are measured on it."""
    return isinstance(splits, MemorySplits) and cfg.dataset != "imagefolder"


def DataPipeline(  # named as what it makes: callers build their data path with it
    splits: Splits | CustomSplits, cfg: RunPlan, ctx: DistContext, device_resident: bool
) -> DataPath:
    """This rank's data path, chosen here and nowhere else: shards streamed, a set held on the
    device (only a set in memory can be moved there), or a DataLoader over the rest."""
    if holds_its_own_statistics(splits, cfg):
        splits.val = view_set(splits.val, cfg.val_resize_size, cfg.val_crop_size)
    path: DataPath
    if isinstance(splits, ShardSplits):
        path = ShardPath(splits, cfg, ctx)
    elif device_resident and isinstance(splits, MemorySplits):
        path = DevicePath(splits, cfg, ctx)
    else:
        path = LoaderPath(splits, cfg, ctx)
    path.check_one_batch()
    return path


class ShardPath(DataPath):
    """--dataset shards: each rank's loader workers stream their parts of the epoch
    (ddpcli.data.shards.feed); decoding and augmentation as for image folders. Its resume
    state is the streams' pieces not yet trained: a resume deals the rest anew, never
    skipping batches."""

    name = "shards"

    def __init__(self, splits: ShardSplits, cfg: RunPlan, ctx: DistContext):
        super().__init__(splits, cfg, ctx)
        self.feed = ShardFeed(
            splits, cfg, ctx, self.workers, *self.member_images(), self.train_stage,
            self.val_stage,
        )  # fmt: skip
        self.train_size, self.val_size = self.feed.train_size, self.feed.val_size

    def member_images(self) -> tuple[Any, Any]:
        """What the workers make of each train and val member: pixels, or its bytes."""
        size, seed = self.cfg.image_size, self.cfg.seed
        if self.decodes_on_device:
            return EncodedMembers(seed, self.augment), EncodedMembers(seed, "none")
        return (
            MemberImages(size, seed, self.augment, **self.recipe()),
            MemberImages(size, seed, "none", view=self.val_view()),
        )

    def check_one_batch(self) -> None:
        if self.steps_per_epoch() == 0:
            raise agreed_error(
                f"the shards' {self.train_size} train samples over {self.ctx.world_size} "
                f"rank(s) give some rank fewer than {LEAST_BATCH}, the least a training batch "
                "holds; pack more samples or run fewer ranks",
                USAGE,
            )

    def steps_per_epoch(self, start: int = 0) -> int:
        return self.feed.steps(start)

    def describe_sizes(self) -> str:
        return (
            f"{self.feed.describe_sizes()} / {self.val_size} val samples · "
            f"{self.splits.num_classes} classes"
        )

    def describe_rest(self, epoch: int, start: int) -> str:
        return self.feed.describe_rest(epoch, start)

    def train_batches(self, epoch: int, skip_batches: int = 0, start: int = 0) -> Any:
        batches = self.feed.train_batches(epoch, start)
        return self.wrapped(batches, cast(list[int], batches.keys), epoch)

    def val_batches(self) -> Any:
        return self.feed.val_batches()

    def state_dict(self, batch_in_epoch: int, epoch_start: int) -> dict[str, Any] | None:
        """The shard streams' pieces not yet trained (a collective on every rank)."""
        return self.feed.position(batch_in_epoch, epoch_start)

    def load_state_dict(self, position: dict[str, Any] | None) -> None:
        self.feed.follow(position)

    def stream_line(self) -> str:
        return self.feed.stream_line()


class SampledPath(DataPath):
    """A set whose epoch DistributedSampler deals (or --ra-reps, or a re-dealt rest): the
    arithmetic the device and loader paths share. A resume skips by position, or re-deals
    the rest from a global sample offset; both live in the TrainState, so `state_dict` is
    None."""

    def check_one_batch(self) -> None:
        if self.steps_per_epoch() == 0:
            world, batch = self.ctx.world_size, self.cfg.per_gpu_batch
            raise agreed_error(
                f"invalid --per-gpu-batch: {self.train_size} train images over {world} "
                f"rank(s) give each {self.shard_size()}, less than one batch of {batch}; "
                f"lower --per-gpu-batch to {self.shard_size()} or less",
                USAGE,
            )

    def shard_size(self) -> int:
        """Each rank's training images per epoch, before batching (DistributedSampler pads)."""
        return math.ceil(self.train_size / self.ctx.world_size)

    def steps_per_epoch(self, start: int = 0) -> int:
        if start:
            return remaining_steps(
                self.train_size, start, self.ctx.world_size, self.cfg.per_gpu_batch
            )
        return self.shard_size() // self.cfg.per_gpu_batch

    def images_per_epoch(self) -> int:
        return self.steps_per_epoch() * self.cfg.per_gpu_batch * self.ctx.world_size

    def describe_sizes(self) -> str:
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

    def train_batches(self, epoch: int, skip_batches: int = 0, start: int = 0) -> Any:
        keys = self.epoch_keys(epoch, start)
        sizes = self.train_batch_sizes(len(keys), start)
        indices, sizes = keys[sum(sizes[:skip_batches]) :], sizes[skip_batches:]
        return self.wrapped(self.batches_of(indices, epoch, sizes), indices, epoch)

    @abstractmethod
    def batches_of(self, indices: list[int], epoch: int, sizes: list[int]) -> Any:
        """The training batches of INDICES, in micro-batches of SIZES."""

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


class DevicePath(SampledPath):
    """--data-path device: the uint8 set lives where it is augmented; batches never cross
    PCIe."""

    name = "device"
    device_resident = True

    def __init__(self, splits: MemorySplits, cfg: RunPlan, ctx: DistContext):
        super().__init__(splits, cfg, ctx)
        # The splits then hold the device copies only: a host copy kept beside them would
        # hold the whole set in host memory for nothing, per rank.
        splits.train = self.train_set = on_device(splits.train, ctx.device)
        splits.val = self.val_set = on_device(splits.val, ctx.device)
        self.train_size, self.val_size = len(splits.train), len(splits.val)

    @property
    def path_name(self) -> str:
        if self.cfg.workers:  # --data-path auto chose this path: the flag is not refused
            return f"{self.name} (no loader: --workers {self.cfg.workers} unused)"
        return self.name

    def batches_of(self, indices: list[int], epoch: int, sizes: list[int]) -> Any:
        return self.device_batches(
            self.train_set, indices, self.augment, epoch, True, self.auto_augment, sizes
        )

    def val_batches(self) -> Any:
        indices = val_shard(self.val_size, self.ctx)
        return self.device_batches(self.val_set, indices, "none", 0, drop_last=False)

    def device_batches(
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


class LoaderPath(SampledPath):
    """--data-path loader: DataLoader workers decode and augment (ddpcli.data.loader), over a
    set in memory, an image folder streamed, or a user's own set."""

    name = "loader"

    def __init__(self, splits: Splits | CustomSplits, cfg: RunPlan, ctx: DistContext):
        super().__init__(splits, cfg, ctx)
        train, val = self.datasets(splits)
        self.train_size, self.val_size = len(train), len(val)
        self.train_loader = self.loader(train, self.train_stage, drop_last=True)
        self.val_loader = self.loader(val, self.val_stage, drop_last=False)

    def datasets(self, splits: Splits | CustomSplits) -> tuple[Any, Any]:
        """The train and validation sets the loaders read, decoded as each kind is."""
        cfg, seed = self.cfg, self.cfg.seed
        size = cfg.image_size
        if isinstance(splits, FolderSplits) and self.decodes_on_device:
            return (
                EncodedFiles(splits.train_samples, seed, self.augment),
                EncodedFiles(splits.val_samples, seed, "none"),
            )
        if isinstance(splits, FolderSplits):
            return (
                FolderDataset(splits.train_samples, size, seed, self.augment, **self.recipe()),
                FolderDataset(splits.val_samples, size, seed, "none", view=self.val_view()),
            )
        if isinstance(splits, CustomSplits):
            classes = splits.num_classes
            return (
                CustomDataset(
                    splits.train, "train", cfg.dataset, classes, size, seed, self.augment
                ),
                CustomDataset(splits.val, "val", cfg.dataset, classes, size, seed, "none"),
            )
        memory = cast(MemorySplits, splits)
        return (
            MemoryDataset(memory.train, seed, self.augment, **self.recipe()),
            MemoryDataset(memory.val, seed, "none"),
        )

    def loader(self, dataset: Any, stage: Stage, drop_last: bool) -> LoaderBatches:
        return LoaderBatches(
            dataset, self.cfg.per_gpu_batch, self.ctx.device, self.mean, self.std, self.workers,
            self.channels_last, drop_last, stage=stage,
            collate_fn=collate_encoded if self.decodes_on_device else None,
        )  # fmt: skip

    def batches_of(self, indices: list[int], epoch: int, sizes: list[int]) -> Any:
        return self.train_loader.for_epoch(indices, epoch, sizes)

    def val_batches(self) -> Any:
        return self.val_loader.for_epoch(val_shard(self.val_size, self.ctx), 0)

    def close(self) -> None:
        self.train_loader.close()
        self.val_loader.close()
