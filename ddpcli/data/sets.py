"""The data sets, read into memory or listed for streaming: the synthetic set, STL-10 (the
official binary layout, own reader; torchvision only downloads it) and ImageNet-layout
folders; and the checks that run before any worker starts.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias, cast

import numpy as np
import torch
import torch.nn.functional as F

from ddpcli import ui
from ddpcli.config.plan import RunPlan
from ddpcli.data.decode import UnreadableImage, read_rgb
from ddpcli.data.layout import (
    IMAGE_SUFFIXES,
    STL10_CLASSES,
    STL10_SIDE,
    Sample,
    check_imagefolder,
    folder_samples,
    listed,
    resize_side,
    stl10_class_names,
    stl10_dir,
    stl10_labels,
    stl10_missing,
    stl10_present,
    training_augment,
)
from ddpcli.data.shards.index import ShardIndex
from ddpcli.data.shards.plan import shard_table
from ddpcli.data.shards.storage import shard_store
from ddpcli.data.shards.stream import MemberBytes, shard_samples
from ddpcli.dist import DistContext, all_gather_object, rank_zero_prepares
from ddpcli.errors import USAGE, DdpcliError, agreed_error, runtime_error, usage_error
from ddpcli.files import atomic_save

# In --out: the image files --skip-bad-images left out, one path a line.
SKIPPED_IMAGES_FILE = "skipped_images.txt"


@dataclass
class ImageSet:
    """A split held in memory: uint8 images (N, 3, H, W) and int64 labels (N,). `sizes`:
    int64 (N, 2), each image's (height, width) as decoded where `images` hold the whole
    image resampled to a square (see `whole_view`); None where they are as decoded."""

    images: torch.Tensor
    labels: torch.Tensor
    sizes: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class MemorySplits:
    """Train and validation splits held in memory."""

    train: ImageSet
    val: ImageSet
    num_classes: int
    class_names: list[str]
    # Image files left out because they cannot be decoded (--skip-bad-images).
    skipped: list[str] = field(default_factory=list)


@dataclass
class FolderSplits:
    """An image folder's train and validation files, streamed by the loader's workers."""

    train_samples: list[Sample]
    val_samples: list[Sample]
    num_classes: int
    class_names: list[str]
    skipped: list[str] = field(default_factory=list)


@dataclass
class ShardSplits:
    """Packed shards (`ddpcli data pack`), streamed by the ranks: where they are, their index,
    and with --skip-bad-images the members left out: split -> shard -> member positions."""

    location: str
    index: ShardIndex
    num_classes: int
    class_names: list[str]
    skipped: list[str] = field(default_factory=list)  # `shard:key` of each member left out
    left_out: dict[str, dict[int, list[int]]] = field(default_factory=dict)


Splits: TypeAlias = MemorySplits | FolderSplits | ShardSplits


# --- Synthetic --------------------------------------------------------------------------


def synthetic_splits(
    train_size: int, image_size: int, seed: int, num_classes: int = 10
) -> MemorySplits:
    """A learnable classification set, deterministic from the seed: each class is a smooth
    colour pattern; samples are contrast-jittered, noisy copies of it."""
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(num_classes, 3, 4, 4, generator=generator)
    shared = torch.rand(1, 3, 4, 4, generator=generator)
    prototypes = F.interpolate(0.7 * shared + 0.3 * coarse, size=image_size, mode="bicubic")

    def make(count: int) -> ImageSet:
        labels = torch.randint(num_classes, (count,), generator=generator)
        images = prototypes[labels]
        contrast = 0.6 + 0.8 * torch.rand(count, 1, 1, 1, generator=generator)
        noise = 0.35 * torch.randn(images.shape, generator=generator)
        images = (images - 0.5) * contrast + 0.5 + noise
        return ImageSet((images.clamp(0, 1) * 255).round().to(torch.uint8), labels)

    train = make(train_size)
    val = make(max(num_classes, train_size // 4))
    return MemorySplits(train, val, num_classes, [f"class{i}" for i in range(num_classes)])


# --- STL-10 -----------------------------------------------------------------------------


def download_stl10(data_dir: Path) -> None:
    """torchvision knows where STL-10 lives; we use it only to fetch and unpack."""
    from torchvision.datasets import STL10
    from torchvision.datasets.utils import download_and_extract_archive

    data_dir.mkdir(parents=True, exist_ok=True)
    download_and_extract_archive(
        STL10.url, download_root=str(data_dir), filename=STL10.filename, md5=STL10.tgz_md5
    )


def read_stl10_split(folder: Path, split: str) -> ImageSet:
    """The official binary layout: uint8 images, channel-major, each channel column-major;
    labels are bytes 1..10."""
    labels = stl10_labels(folder, split)
    raw = np.fromfile(folder / f"{split}_X.bin", dtype=np.uint8)
    images = raw.reshape(len(labels), 3, STL10_SIDE, STL10_SIDE).transpose(0, 1, 3, 2)
    return ImageSet(
        torch.from_numpy(np.ascontiguousarray(images)), torch.tensor(labels, dtype=torch.int64)
    )


def stl10_splits(data_dir: Path, download: bool, ctx: DistContext) -> MemorySplits:
    if not stl10_present(data_dir):
        if not download:
            raise stl10_missing(data_dir)
        with rank_zero_prepares(ctx, f"download STL-10 (2.6 GB) into {data_dir}"):
            if ctx.is_main and not stl10_present(data_dir):
                download_stl10(data_dir)
    folder = stl10_dir(data_dir)
    train, val = read_stl10_split(folder, "train"), read_stl10_split(folder, "test")
    return MemorySplits(train, val, STL10_CLASSES, stl10_class_names(folder))


# --- Image folders (ImageNet layout) ----------------------------------------------------


def centre_view(image: torch.Tensor, image_size: int) -> torch.Tensor:
    """Validation's view of an image folder's image (and crop-flip's before it crops)."""
    return centre_view_at(image, resize_side(image_size), image_size)


def centre_view_at(image: torch.Tensor, resize: int, crop: int) -> torch.Tensor:
    """The shorter side resized to RESIZE, then the centre CROP x CROP (torchvision's
    reference evaluation: --val-resize-size, --val-crop-size)."""
    from torchvision.transforms.v2 import functional as TF

    image = TF.resize(image, resize, antialias=True)
    return TF.center_crop(image, [crop, crop])


def whole_view(image: torch.Tensor, image_size: int) -> torch.Tensor:
    """The whole image squeezed to a square of side resize_side(image_size): what the device
    path keeps for random-resized crops. A box anywhere in the image can be cut from it (in
    relative coordinates, which also restores the aspect), and even the whole image then
    shrinks by at most 1/0.875 to the training size, so bilinear sampling needs no
    antialiasing."""
    from torchvision.transforms.v2 import functional as TF

    side = resize_side(image_size)
    return TF.resize(image, [side, side], antialias=True)


def decode_folder(
    split_dir: Path,
    classes: list[str],
    image_size: int,
    skip_bad_images: bool = False,
    whole: bool = False,
) -> tuple[ImageSet, list[str]]:
    """Decode once to uint8: each image's centre_view, or with `whole` its whole_view and its
    size. An image that cannot be decoded stops the run, or with `skip_bad_images` is left
    out and listed."""
    samples = folder_samples(split_dir, classes)
    if not samples:
        raise usage_error(f"{split_dir} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    view, side = (whole_view, resize_side(image_size)) if whole else (centre_view, image_size)
    images = torch.empty(len(samples), 3, side, side, dtype=torch.uint8)
    sizes = torch.empty(len(samples), 2, dtype=torch.int64)
    labels: list[int] = []
    skipped: list[str] = []
    for path, label in samples:
        try:
            decoded = read_rgb(path)
        except UnreadableImage:
            if not skip_bad_images:
                raise
            skipped.append(str(path))
            continue
        sizes[len(labels)] = torch.tensor(decoded.shape[1:])
        images[len(labels)] = view(decoded, image_size)
        labels.append(label)
    if skipped:  # a copy: a view would save the whole buffer
        images, sizes = images[: len(labels)].clone(), sizes[: len(labels)].clone()
    image_set = ImageSet(images, torch.tensor(labels, dtype=torch.int64), sizes if whole else None)
    return image_set, skipped


def folder_cache_path(data_dir: Path, image_size: int, cache_dir: Path, whole_train: bool) -> Path:
    """Keyed by the folder, the size, the view and the newest modification, so edits
    invalidate it."""
    newest = max((p.stat().st_mtime_ns for p in data_dir.rglob("*")), default=0)
    view = "whole" if whole_train else "centre"
    key = hashlib.sha256(f"{data_dir.resolve()}|{image_size}|{newest}".encode()).hexdigest()
    return cache_dir / f"imagefolder-{image_size}px-{view}-{key[:16]}.pt"


def imagefolder_splits(
    data_dir: Path,
    image_size: int,
    decode_once: bool,
    cache_dir: Path,
    ctx: DistContext,
    skip_bad_images: bool = False,
    whole_train: bool = False,
) -> Splits:
    """`whole_train`: the device path's training images kept whole, for random-resized crops;
    validation is always the centre view."""
    classes = check_imagefolder(data_dir)
    if not decode_once:  # the loader's workers decode each image as it is needed
        train, val = (folder_samples(data_dir / split, classes) for split in ("train", "val"))
        skipped: list[str] = []
        if skip_bad_images:
            train, val, skipped = drop_unreadable(train, val, ctx)
        check_split_sizes(data_dir, len(train), len(val), skipped)
        check_classes_kept(data_dir / "train", classes, [label for _, label in train], skipped)
        return FolderSplits(train, val, len(classes), classes, skipped)
    cache = folder_cache_path(data_dir, image_size, cache_dir, whole_train)
    with rank_zero_prepares(ctx, f"decode {data_dir} once into {cache}"):
        if ctx.is_main and not cache.exists():
            splits = {
                split: decode_folder(data_dir / split, classes, image_size, skip_bad_images, whole)
                for split, whole in (("train", whole_train), ("val", False))
            }
            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_save(
                {
                    split: {**vars(images), "skipped": skipped}
                    for split, (images, skipped) in splits.items()
                },
                cache,
            )
    stored = torch.load(cache, weights_only=True)
    train_set, val_set = (
        ImageSet(stored[s]["images"], stored[s]["labels"], stored[s]["sizes"])
        for s in ("train", "val")
    )
    skipped = [path for split in ("train", "val") for path in stored[split].get("skipped", [])]
    if skipped and not skip_bad_images:  # the cache of a run that skipped them
        read_rgb(Path(skipped[0]))  # raises UnreadableImage, saying why
        raise usage_error(f"{cache} lacks {skipped[0]}: delete the cache and start again")
    check_split_sizes(data_dir, len(train_set), len(val_set), skipped)
    check_classes_kept(data_dir / "train", classes, train_set.labels.tolist(), skipped)
    return MemorySplits(train_set, val_set, len(classes), classes, skipped=skipped)


def check_split_sizes(data_dir: Path, train: int, val: int, skipped: list[str]) -> None:
    """--skip-bad-images must leave images to train and validate on. Every rank finds it
    from the same files: said once."""
    for split, count in (("train", train), ("val", val)):
        if count == 0:
            raise agreed_error(
                f"no image in {data_dir / split} can be decoded ({len(skipped)} skipped, "
                f"first {skipped[0] if skipped else 'none'}); check the files",
                USAGE,
            )


def check_classes_kept(
    train_dir: Path, classes: list[str], train_labels: list[int], skipped: list[str]
) -> None:
    """--skip-bad-images must leave every training class an image, as the layout check
    asks of a folder without it: a class with none would be trained on without a word."""
    kept = set(train_labels)
    emptied = [name for label, name in enumerate(classes) if label not in kept]
    if not emptied:
        return
    folders = tuple(f"{train_dir / name}{os.sep}" for name in emptied)
    theirs = [path for path in skipped if path.startswith(folders)]
    raise agreed_error(
        f"--skip-bad-images left no image in {train_dir}'s class{'es' if len(emptied) > 1 else ''} "
        f"{listed(emptied)} ({len(theirs)} skipped, first {theirs[0] if theirs else 'none'}); "
        "fix those files, or remove the class folder",
        USAGE,
    )


def is_readable(path: Path) -> bool:
    try:
        read_rgb(path)
    except UnreadableImage:
        return False
    return True


def drop_unreadable(
    train: list[Sample], val: list[Sample], ctx: DistContext
) -> tuple[list[Sample], list[Sample], list[str]]:
    """--skip-bad-images on the loader path: every image decoded once before training, each
    rank a strided share on its threads (PIL lets go of the GIL while it decodes), and the
    ranks pool what they found: every rank drops the same files, so the shards stay equal."""
    paths = [path for path, _ in train + val]
    if ctx.is_main:
        ui.info(f"--skip-bad-images: decoding each of {len(paths)} images once before training")
    mine = paths[ctx.rank :: ctx.world_size]
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        found = [str(p) for p, ok in zip(mine, pool.map(is_readable, mine), strict=True) if not ok]
    bad = {path for share in all_gather_object(found, ctx) for path in share}

    def kept(samples: Iterable[Sample]) -> list[Sample]:
        return [sample for sample in samples if str(sample[0]) not in bad]

    return kept(train), kept(val), [str(path) for path in paths if str(path) in bad]


def resize_set(image_set: ImageSet, image_size: int) -> ImageSet:
    resized = F.interpolate(
        image_set.images.float(), size=image_size, mode="bilinear", antialias=True
    )
    return ImageSet(resized.round().clamp(0, 255).to(torch.uint8), image_set.labels)


def view_set(image_set: ImageSet, resize: int, crop: int) -> ImageSet:
    """An in-memory split seen as validation sees it: the shorter side resized to RESIZE
    and the centre CROP, done once (--val-resize-size, --val-crop-size)."""
    if image_set.images.shape[-2:] == (resize, resize) and resize == crop:
        return image_set
    images = torch.stack([centre_view_at(image, resize, crop) for image in image_set.images])
    return ImageSet(images, image_set.labels)


# --- Shards (`ddpcli data pack`) ---------------------------------------------------------


def shard_splits(location: Path | str, ctx: DistContext, skip_bad_images: bool) -> ShardSplits:
    """The index of LOCATION, checked (ddpcli.data.shards.checks); with --skip-bad-images
    every image decoded once first, as the folder path's loader does, so that the epoch's
    sample count (and so every rank's steps) is known before the first step."""
    from ddpcli.data.shards.checks import check_shard_source

    try:
        index = check_shard_source(location)
    except DdpcliError as error:
        # The launcher checked it: a failure now (the server gone since, a shard deleted)
        # is a fault at run time, not bad input.
        raise runtime_error(error.message) from None
    classes = index.splits["train"].classes
    splits = ShardSplits(str(location), index, len(classes), classes)
    if skip_bad_images:
        splits.left_out, splits.skipped = unreadable_members(splits, ctx)
        train, val = (
            index.splits[split].samples
            - sum(len(positions) for positions in splits.left_out[split].values())
            for split in ("train", "val")
        )
        check_split_sizes(Path(str(location)), train, val, splits.skipped)
    return splits


def unreadable_members(
    splits: ShardSplits, ctx: DistContext
) -> tuple[dict[str, dict[int, list[int]]], list[str]]:
    """Every member that cannot be decoded, found by the ranks together (each a strided
    share of the shards) and pooled: split -> shard -> positions, and their `shard:key`."""
    tasks = [
        (split, shard)
        for split in ("train", "val")
        for shard in range(len(splits.index.splits[split].shards))
    ]
    if ctx.is_main:
        ui.info(f"--skip-bad-images: decoding each image of {len(tasks)} shards once first")
    mine = [found for task in tasks[ctx.rank :: ctx.world_size] for found in bad_in(splits, *task)]
    left_out: dict[str, dict[int, list[int]]] = {"train": {}, "val": {}}
    names = []
    for split, shard, position, name in sorted(
        found for share in all_gather_object(mine, ctx) for found in share
    ):
        left_out[split].setdefault(shard, []).append(position)
        names.append(name)
    return left_out, names


def bad_in(splits: ShardSplits, split: str, shard: int) -> list[tuple[str, int, int, str]]:
    table = shard_table(splits.index.splits[split])
    store = shard_store(splits.location)
    bad = []
    for sample in shard_samples(store, table, shard, 0, table.counts[shard]):
        try:
            read_rgb(cast(Path, MemberBytes(sample.image, sample.name)))
        except UnreadableImage:
            bad.append((split, shard, sample.number - table.firsts[shard], sample.name))
    return bad


# --- Loading and checking, as the run asks ------------------------------------------


def load_splits(cfg: RunPlan, ctx: DistContext, device_resident: bool) -> Splits:
    """The splits in memory; an image folder only listed unless it will be device-resident."""
    image_size = cfg.image_size
    if cfg.dataset == "shards":
        location = cfg.data_dir if cfg.data_dir is not None else cfg.data_folder
        return shard_splits(location, ctx, cfg.skip_bad_images)
    if cfg.dataset == "synthetic":
        return synthetic_splits(cfg.synthetic_size, image_size, cfg.seed)
    if cfg.dataset == "stl10":
        splits = stl10_splits(cfg.data_folder, cfg.download, ctx)
        if image_size != STL10_SIDE:
            splits.train = resize_set(splits.train, image_size)
            splits.val = resize_set(splits.val, image_size)
        return splits
    cache_dir = cfg.out / "cache"
    whole_train = training_augment(cfg.augment, cfg.dataset) == "rrc"
    return imagefolder_splits(
        cfg.data_folder, image_size, device_resident, cache_dir, ctx, cfg.skip_bad_images,
        whole_train,
    )  # fmt: skip
