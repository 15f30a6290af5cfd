"""The images `ddpcli eval` measures, as validation saw them (the same view, the same
normalisation, the same loaders), and how they are dealt to the ranks.

Dealing: the split is cut into fixed batches of `per_gpu_batch` consecutive images, and
rank r takes batches r, r + world, ... Every image is counted once, nothing is padded, and
each image goes through the model in the same batch at any world size: a sample's logits
move by ~1e-7 with the other images of its batch, so strided shards (validation's) would
change the loss in its last digits from one world to another; fixed batches keep every
figure bit for bit the same.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddpcli.config import TrainConfig
from ddpcli.data.custom import CustomDataset, custom_splits
from ddpcli.data.decode import read_rgb_at_least
from ddpcli.data.device import DeviceResidentBatches
from ddpcli.data.layout import resize_side, stl10_dir, stl10_missing, stl10_present
from ddpcli.data.loader import FolderDataset, LoaderBatches, default_workers
from ddpcli.data.pipeline import IMAGENET_MEAN, IMAGENET_STD, channel_stats
from ddpcli.data.sets import (
    ImageSet,
    centre_view_at,
    read_stl10_split,
    resize_set,
    synthetic_splits,
    view_set,
)
from ddpcli.data.shards.plan import ShardTable, shard_table
from ddpcli.data.shards.storage import ShardStore, shard_store
from ddpcli.data.shards.stream import MemberBytes, RawSample, shard_samples
from ddpcli.dist import DistContext
from ddpcli.errors import usage_error
from ddpcli.evaluation.plan import EvalPlan, folder_of_split, samples_of, shard_split


def dealt_batches(size: int, batch: int, world_size: int, rank: int) -> list[list[int]]:
    """RANK's batches of a split of SIZE images: fixed batches of BATCH consecutive
    indices (the last one shorter), dealt round-robin. No padding, no duplicate."""
    starts = range(rank * batch, size, world_size * batch)
    return [list(range(start, min(start + batch, size))) for start in starts]


@dataclass
class EvalImages:
    """One split ready to be batched: an in-memory set or a loader's data set, the name of
    each image (its file, or its index), and the normalisation its model was trained with."""

    source: ImageSet | Any  # an ImageSet (synthetic, STL-10) or a KeyedImages
    names: list[str]
    mean: list[float]
    std: list[float]

    def __len__(self) -> int:
        return len(self.names)

    def batches(
        self, plan: EvalPlan, ctx: DistContext, dealt: list[list[int]]
    ) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        indices = [index for batch in dealt for index in batch]
        sizes = [len(batch) for batch in dealt]
        if isinstance(self.source, ImageSet):
            return DeviceResidentBatches(
                self.source, indices, plan.per_gpu_batch, ctx.device, self.mean, self.std,
                "none", plan.seed, 0, batch_sizes=sizes,
            )  # fmt: skip
        workers = loader_workers(plan.workers, len(indices), ctx.local_world_size)
        loader = LoaderBatches(
            self.source, plan.per_gpu_batch, ctx.device, self.mean, self.std, workers,
            ctx.device.type == "cuda", False, persistent=False,  # one pass: workers end with it
        )  # fmt: skip
        return loader.for_epoch(indices, 0, sizes)


# Below this many images a rank decodes them itself: starting a loader worker costs more.
FEW_IMAGES = 256


def loader_workers(given: int | None, images: int, local_world_size: int) -> int:
    if given is not None:
        return given
    return 0 if images < FEW_IMAGES else default_workers(local_world_size)


def load_images(plan: EvalPlan) -> EvalImages:
    """The split the plan names, viewed and normalised as the run validated."""
    if plan.dataset == "synthetic":
        return synthetic_images(plan)
    if plan.dataset == "stl10":
        return stl10_images(plan)
    if plan.dataset == "imagefolder":
        return folder_images(plan)
    if plan.dataset == "shards":
        return shard_images(plan)
    return custom_images(plan)


def normalization(plan: EvalPlan, train: ImageSet | None) -> tuple[list[float], list[float]]:
    """What the checkpoint recorded; for an older file, what training measured (in-memory
    sets: their training split's statistics) or ImageNet's (folders, the user's sets)."""
    if plan.normalization:
        return list(plan.normalization["mean"]), list(plan.normalization["std"])
    if train is not None:
        return channel_stats(train.images)
    return IMAGENET_MEAN, IMAGENET_STD


def in_memory(plan: EvalPlan, train: ImageSet, chosen: ImageSet) -> EvalImages:
    mean, std = normalization(plan, train)
    viewed = view_set(chosen, plan.val_resize_size or plan.crop_size, plan.crop_size)
    return EvalImages(viewed, [str(index) for index in range(len(viewed))], mean, std)


def synthetic_images(plan: EvalPlan) -> EvalImages:
    splits = synthetic_splits(plan.synthetic_size, plan.image_size, plan.seed)
    chosen = splits.train if plan.split == "train" else splits.val
    return in_memory(plan, splits.train, chosen)


def stl10_images(plan: EvalPlan) -> EvalImages:
    data_dir = Path(plan.data_dir or ".")
    if not stl10_present(data_dir):
        raise stl10_missing(data_dir)
    folder = stl10_dir(data_dir)
    train = read_stl10_split(folder, "train")
    # STL-10's labelled held-out images are its test split: training validates on them.
    chosen = train if plan.split == "train" else read_stl10_split(folder, "test")
    if plan.image_size != train.images.shape[-1]:
        train, chosen = resize_set(train, plan.image_size), resize_set(chosen, plan.image_size)
    return in_memory(plan, train, chosen)


def folder_images(plan: EvalPlan) -> EvalImages:
    split_dir = folder_of_split(Path(plan.data_dir or "."), plan.split)
    samples = samples_of(split_dir, plan.classes)
    if not samples:
        raise usage_error(f"{split_dir} holds no images of the checkpoint's classes")
    view = (plan.val_resize_size or resize_side(plan.crop_size), plan.crop_size)
    dataset = FolderDataset(samples, plan.image_size, plan.seed, "none", view=view)
    mean, std = normalization(plan, None)
    return EvalImages(dataset, [str(path) for path, _ in samples], mean, std)


def custom_images(plan: EvalPlan) -> EvalImages:
    spec = plan.dataset
    cfg = TrainConfig.model_validate(
        {"dataset": spec, "data_dir": plan.data_dir, "image_size": plan.image_size}
    )
    splits = custom_splits(cfg)
    chosen = splits.train if plan.split == "train" else splits.val
    dataset = CustomDataset(
        chosen, plan.split, spec, splits.num_classes, plan.image_size, plan.seed, "none"
    )
    mean, std = normalization(plan, None)
    return EvalImages(dataset, [str(index) for index in range(len(dataset))], mean, std)


class ShardMembers(FolderDataset):
    """A packed split read by position (sample number, in the index's order), for eval's
    fixed batches: each loader worker holds the one shard its batch falls in, read whole
    through the store, and decodes the member as the folder path decodes a file. A rank
    reads only the shards its batches touch; the labels are mapped to the checkpoint's
    class order by name."""

    def __init__(self, store: ShardStore, table: ShardTable, labels: list[int], view, **kw):
        super().__init__([], **kw, view=view)
        self.store, self.table, self.labels = store, table, labels
        self.held: tuple[int, list[RawSample]] | None = None

    def __len__(self) -> int:
        return self.table.samples

    def member(self, index: int) -> RawSample:
        shard = bisect.bisect_right(self.table.firsts, index) - 1
        if self.held is None or self.held[0] != shard:
            end = self.table.counts[shard]
            self.held = (shard, list(shard_samples(self.store, self.table, shard, 0, end)))
        return self.held[1][index - self.table.firsts[shard]]

    def centred(self, index: int) -> tuple[torch.Tensor, int]:
        sample = self.member(index)
        resize, crop = self.view
        image = read_rgb_at_least(MemberBytes(sample.image, sample.name), resize)
        return centre_view_at(image, resize, crop), self.labels[sample.label]


def shard_images(plan: EvalPlan) -> EvalImages:
    split = shard_split(plan.data_dir or ".", plan.split)
    table = shard_table(split)
    labels = [plan.classes.index(name) for name in split.classes]  # checked: all are there
    view = (plan.val_resize_size or resize_side(plan.crop_size), plan.crop_size)
    members = ShardMembers(
        shard_store(plan.data_dir or "."), table, labels, view,
        image_size=plan.image_size, seed=plan.seed, augment="none",
    )  # fmt: skip
    names = [
        f"{name}#{position}"
        for name, count in zip(table.names, table.counts, strict=True)
        for position in range(count)
    ]
    mean, std = normalization(plan, None)
    return EvalImages(members, names, mean, std)
