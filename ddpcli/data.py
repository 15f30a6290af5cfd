"""Datasets, sharding and batches.

Two paths give the same batches for the same seed, epoch and indices:
- the device path: a set that fits (the synthetic set, STL-10, an image folder after a
  one-time decode) is held in device memory as uint8 and augmented in batches on the
  device: no DataLoader workers, no per-image Python;
- the loader path: a DataLoader whose workers persist across epochs crops and flips each
  image (a large image folder is decoded there too), pinned memory, non-blocking copies.
Both shard training with DistributedSampler (same indices, `set_epoch` each epoch) and
shard validation so every sample is counted exactly once.
"""

from __future__ import annotations

import abc
import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from ddpcli.config import TrainConfig
from ddpcli.dist import DistContext, zero_first
from ddpcli.errors import usage_error
from ddpcli.files import atomic_save

CROP_PADDING = 4
# Image folders are normalised with ImageNet's statistics on both paths (as torchvision's
# reference recipes do); the in-memory sets with their own, measured on the training split.
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
STL10_SIDE = 96
STL10_IMAGE_BYTES = 3 * STL10_SIDE * STL10_SIDE
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp", ".tif", ".tiff"}


@dataclass
class ImageSet:
    """A split held in memory: uint8 images (N, 3, H, W) and int64 labels (N,)."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class Splits:
    train: ImageSet | None
    val: ImageSet | None
    num_classes: int
    class_names: list[str]
    # For the loader path: folders to stream instead of tensors in memory.
    train_dir: Path | None = None
    val_dir: Path | None = None


# --- Synthetic --------------------------------------------------------------------------


def synthetic_splits(train_size: int, image_size: int, seed: int, num_classes: int = 10) -> Splits:
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
    return Splits(train, val, num_classes, [f"class{i}" for i in range(num_classes)])


# --- STL-10 -----------------------------------------------------------------------------


def stl10_dir(data_dir: Path) -> Path:
    return data_dir / "stl10_binary"


def stl10_present(data_dir: Path) -> bool:
    folder = stl10_dir(data_dir)
    names = ("train_X.bin", "train_y.bin", "test_X.bin", "test_y.bin")
    return all((folder / name).is_file() for name in names)


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
    images_path, labels_path = folder / f"{split}_X.bin", folder / f"{split}_y.bin"
    raw = np.fromfile(images_path, dtype=np.uint8)
    if raw.size == 0 or raw.size % STL10_IMAGE_BYTES:
        raise usage_error(
            f"{images_path} is truncated or not STL-10 ({raw.size} bytes is not a multiple of "
            f"{STL10_IMAGE_BYTES}); delete it and pass --download"
        )
    labels = np.fromfile(labels_path, dtype=np.uint8).astype(np.int64) - 1
    count = raw.size // STL10_IMAGE_BYTES
    if len(labels) != count:
        raise usage_error(f"{labels_path} has {len(labels)} labels for {count} images")
    if labels.min() < 0 or labels.max() > 9:
        raise usage_error(f"{labels_path} holds labels outside 1..10: not STL-10")
    images = raw.reshape(count, 3, STL10_SIDE, STL10_SIDE).transpose(0, 1, 3, 2)
    return ImageSet(torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels))


def stl10_splits(data_dir: Path, download: bool, ctx: DistContext) -> Splits:
    if not stl10_present(data_dir):
        if not download:
            raise usage_error(
                f"STL-10 not found in {stl10_dir(data_dir)}; pass --download to fetch it "
                "(2.6 GB) or point --data-dir at the folder that holds stl10_binary/"
            )
        with zero_first(ctx):
            if ctx.is_main and not stl10_present(data_dir):
                download_stl10(data_dir)
    folder = stl10_dir(data_dir)
    names_file = folder / "class_names.txt"
    names = names_file.read_text().split() if names_file.is_file() else []
    names = names if len(names) == 10 else [f"class{i}" for i in range(10)]
    return Splits(read_stl10_split(folder, "train"), read_stl10_split(folder, "test"), 10, names)


# --- Image folders (ImageNet layout) ----------------------------------------------------


def folder_classes(split_dir: Path) -> list[str]:
    return sorted(entry.name for entry in split_dir.iterdir() if entry.is_dir())


def folder_samples(split_dir: Path, classes: list[str]) -> list[tuple[Path, int]]:
    samples = []
    for label, name in enumerate(classes):
        class_dir = split_dir / name
        if not class_dir.is_dir():
            continue
        for path in sorted(class_dir.rglob("*")):
            if path.suffix.lower() in IMAGE_SUFFIXES:
                samples.append((path, label))
    return samples


def check_imagefolder(data_dir: Path) -> list[str]:
    """Fail early, before any process starts, if the layout is not train/<class>/*."""
    for split in ("train", "val"):
        if not (data_dir / split).is_dir():
            raise usage_error(
                f"{data_dir / split} is missing: --dataset imagefolder expects "
                "DATA_DIR/train/<class>/*.jpg and DATA_DIR/val/<class>/*.jpg"
            )
    classes = folder_classes(data_dir / "train")
    if len(classes) < 2:
        raise usage_error(f"{data_dir / 'train'} needs at least two class folders")
    return classes


def decode_folder(split_dir: Path, classes: list[str], image_size: int) -> ImageSet:
    """Decode once to uint8 at the training size: shorter side resized, centre crop."""
    from torchvision.transforms.v2 import functional as TF

    samples = folder_samples(split_dir, classes)
    if not samples:
        raise usage_error(f"{split_dir} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    images = torch.empty(len(samples), 3, image_size, image_size, dtype=torch.uint8)
    for index, (path, _) in enumerate(samples):
        image = TF.resize(read_rgb(path), image_size, antialias=True)
        images[index] = TF.center_crop(image, [image_size, image_size])
    labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
    return ImageSet(images, labels)


def folder_cache_path(data_dir: Path, image_size: int, cache_dir: Path) -> Path:
    """Keyed by the folder, the size and the newest modification, so edits invalidate it."""
    newest = max((p.stat().st_mtime_ns for p in data_dir.rglob("*")), default=0)
    key = hashlib.sha256(f"{data_dir.resolve()}|{image_size}|{newest}".encode()).hexdigest()
    return cache_dir / f"imagefolder-{image_size}px-{key[:16]}.pt"


def imagefolder_splits(
    data_dir: Path, image_size: int, in_memory: bool, cache_dir: Path, ctx: DistContext
) -> Splits:
    classes = check_imagefolder(data_dir)
    if not in_memory:
        return Splits(None, None, len(classes), classes, data_dir / "train", data_dir / "val")
    cache = folder_cache_path(data_dir, image_size, cache_dir)
    with zero_first(ctx):
        if ctx.is_main and not cache.exists():
            splits = {
                split: decode_folder(data_dir / split, classes, image_size)
                for split in ("train", "val")
            }
            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_save(
                {k: {"images": v.images, "labels": v.labels} for k, v in splits.items()}, cache
            )
    stored = torch.load(cache, weights_only=True)
    train, val = (ImageSet(stored[s]["images"], stored[s]["labels"]) for s in ("train", "val"))
    return Splits(train, val, len(classes), classes)


# --- Checks before any worker starts ---------------------------------------------------


def check_data_source(cfg: TrainConfig) -> None:
    """The data set named by the flags is there (or can be fetched): exit 2 otherwise."""
    if cfg.dataset == "synthetic" or cfg.data_dir is None:
        return
    if not cfg.data_dir.is_dir() and not (cfg.dataset == "stl10" and cfg.download):
        hint = "; add --download to fetch STL-10 into it" if cfg.dataset == "stl10" else ""
        raise usage_error(
            f"invalid --data-dir: {cfg.data_dir} does not exist or is not a folder{hint}"
        )
    if cfg.dataset == "stl10" and not cfg.download and not stl10_present(cfg.data_dir):
        raise usage_error(
            f"STL-10 not found in {stl10_dir(cfg.data_dir)}; pass --download to fetch it "
            "or point --data-dir at the folder that holds stl10_binary/"
        )
    if cfg.dataset == "imagefolder":
        check_imagefolder(cfg.data_dir)


# --- Sharding ---------------------------------------------------------------------------


def train_shard(size: int, ctx: DistContext, seed: int, epoch: int) -> list[int]:
    """This rank's training indices for the epoch: exactly what DistributedSampler yields.
    It pads so every rank gets the same count (and the same number of steps)."""
    sampler = DistributedSampler(
        range(size), num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=seed
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


# --- Augmentation that depends only on (seed, epoch, sample) ------------------------------

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (
    _signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
)


def _shift_right(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift on int64 (torch's >> is arithmetic)."""
    return (values >> bits) & ((1 << (64 - bits)) - 1)


def sample_hash(seed: int, epoch: int, indices: torch.Tensor) -> torch.Tensor:
    """splitmix64 of (seed, epoch, index), computed the same on any device. A sample's crop
    and flip then never depend on which rank sees it, in which batch, or after a resume."""
    base = (seed * 1_000_003 + epoch * 7_919) & _MASK64
    z = indices.to(torch.int64) + _signed(base) + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def augmentation_draws(seed: int, epoch: int, indices: torch.Tensor):
    """Per sample: crop offsets (rows, cols) in 0..2*padding, and whether to flip."""
    h = sample_hash(seed, epoch, indices)
    span = 2 * CROP_PADDING + 1
    top = _shift_right(h, 40) % span
    left = _shift_right(h, 20) % span
    flip = (h & 1) == 1
    return top, left, flip


# --- Batches in memory, augmented in batches on the device -------------------------------


class TensorBatches:
    """Batches of an in-memory ImageSet, on `device`: gather, random crop with padding,
    horizontal flip and normalisation done for the whole batch at once."""

    def __init__(
        self,
        images: ImageSet,
        indices: list[int],
        batch_size: int,
        device: torch.device,
        mean: list[float],
        std: list[float],
        augment: bool,
        seed: int,
        epoch: int,
        channels_last: bool = False,
    ):
        self.images = images.images.to(device)
        self.labels = images.labels.to(device)
        self.indices = torch.tensor(indices, dtype=torch.long)
        self.batch_size = batch_size
        self.device = device
        self.mean = torch.tensor(mean, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(std, device=device).view(1, 3, 1, 1)
        self.augment = augment
        self.seed, self.epoch = seed, epoch
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __len__(self) -> int:
        return math.ceil(len(self.indices) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(self.indices), self.batch_size):
            batch = self.indices[start : start + self.batch_size].to(self.device)
            images = self.images[batch]
            if self.augment:
                images = self._crop_and_flip(images, batch)
            images = (images.float().div_(255) - self.mean) / self.std
            yield images.contiguous(memory_format=self.memory_format), self.labels[batch]

    def _crop_and_flip(self, images: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        count, _, height, width = images.shape
        pad = CROP_PADDING
        top, left, flips = augmentation_draws(self.seed, self.epoch, indices)
        padded = F.pad(images, (pad, pad, pad, pad))
        if images.device.type == "cpu":
            # A slice per sample is ~9x cheaper on the CPU than the 4-D gather; same pixels.
            out = torch.empty_like(images)
            draws = zip(top.tolist(), left.tolist(), flips.tolist(), strict=True)
            for row, (y, x, flip) in enumerate(draws):
                out[row] = crop_padded(padded[row], y, x, flip, height, width)
            return out
        rows = top.view(count, 1) + torch.arange(height, device=self.device)
        cols = left.view(count, 1) + torch.arange(width, device=self.device)
        cols = torch.where(flips.view(count, 1), cols.flip(1), cols)
        batch_index = torch.arange(count, device=self.device).view(count, 1, 1, 1)
        channel_index = torch.arange(3, device=self.device).view(1, 3, 1, 1)
        return padded[batch_index, channel_index, rows.view(count, 1, height, 1),
                      cols.view(count, 1, 1, width)]  # fmt: skip


# --- Batches streamed from disk through a DataLoader -------------------------------------


def read_rgb(path: Path) -> torch.Tensor:
    """uint8 (3, H, W). PIL decodes: torchvision.io's decoders are deprecated from 0.29."""
    from PIL import Image
    from torchvision.transforms.v2.functional import pil_to_tensor

    with Image.open(path) as image:
        return pil_to_tensor(image.convert("RGB"))


class KeyedImages(torch.utils.data.Dataset, abc.ABC):
    """The loader path's twin of TensorBatches. Items are keyed by (index, epoch): workers
    persist across epochs, so the epoch travels with each index instead of living in a
    copy of the dataset that the workers would never see change."""

    def __init__(self, seed: int, augment: bool):
        self.seed, self.augment = seed, augment

    @abc.abstractmethod
    def load(self, index: int) -> tuple[torch.Tensor, int]:
        """uint8 (3, H, W) at the training size, and the label."""

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        index, epoch = key
        image, label = self.load(index)
        if self.augment:
            image = crop_and_flip_one(image, index, self.seed, epoch)
        return image, label


class MemoryDataset(KeyedImages):
    """An in-memory ImageSet served through the DataLoader (`--data-path loader`)."""

    def __init__(self, image_set: ImageSet, seed: int, augment: bool):
        super().__init__(seed, augment)
        self.image_set = image_set

    def __len__(self) -> int:
        return len(self.image_set)

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        return self.image_set.images[index], int(self.image_set.labels[index])


class FolderDataset(KeyedImages):
    """ImageNet-layout images, decoded and resized per item in DataLoader workers."""

    def __init__(
        self, split_dir: Path, classes: list[str], image_size: int, seed: int, augment: bool
    ):
        super().__init__(seed, augment)
        self.samples = folder_samples(split_dir, classes)
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        from torchvision.transforms.v2 import functional as TF

        path, label = self.samples[index]
        image = TF.resize(read_rgb(path), self.image_size, antialias=True)
        return TF.center_crop(image, [self.image_size, self.image_size]), label


def crop_and_flip_one(image: torch.Tensor, index: int, seed: int, epoch: int) -> torch.Tensor:
    """The per-image twin of TensorBatches._crop_and_flip: same draws, same pixels."""
    top, left, flip = (int(v) for v in augmentation_draws(seed, epoch, torch.tensor([index])))
    pad, height, width = CROP_PADDING, image.shape[1], image.shape[2]
    return crop_padded(F.pad(image, (pad, pad, pad, pad)), top, left, flip, height, width)


def crop_padded(
    padded: torch.Tensor, top: int, left: int, flip: bool, height: int, width: int
) -> torch.Tensor:
    """One (3, height, width) crop of a padded image at (top, left), mirrored if `flip`."""
    crop = padded[:, top : top + height, left : left + width]
    return crop.flip(2) if flip else crop


class ShardSampler(torch.utils.data.Sampler):
    """This rank's indices for one epoch, as (index, epoch) keys. It lives in the main
    process, so a persistent DataLoader picks up the new shard at each `iter()`."""

    def __init__(self):
        self.indices: list[int] = []
        self.epoch = 0

    def set_shard(self, indices: list[int], epoch: int) -> None:
        self.indices, self.epoch = list(indices), epoch

    def __iter__(self):
        epoch = self.epoch
        return iter([(index, epoch) for index in self.indices])

    def __len__(self) -> int:
        return len(self.indices)


class LoaderBatches:
    """One DataLoader for the whole run: workers start once and persist across epochs,
    pinned memory, prefetching and non-blocking copies; normalisation on the device."""

    def __init__(self, dataset, batch_size, device, mean, std, workers, channels_last):
        self.sampler = ShardSampler()
        self.loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            persistent_workers=workers > 0,
            prefetch_factor=4 if workers else None,
        )
        self.device = device
        self.mean = torch.tensor(mean, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(std, device=device).view(1, 3, 1, 1)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def for_epoch(self, indices: list[int], epoch: int) -> LoaderBatches:
        self.sampler.set_shard(indices, epoch)
        return self

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for images, labels in self.loader:
            images = images.to(self.device, non_blocking=True)
            images = (images.float().div_(255) - self.mean) / self.std
            yield (
                images.contiguous(memory_format=self.memory_format),
                labels.to(self.device, non_blocking=True),
            )


def default_workers(local_world_size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0, min(8, (cores or 1) // max(1, local_world_size) - 1))


class TracedBatches:
    """Batches that append each batch's sample indices to a file as they are handed out
    (DDPCLI_TRACE_SAMPLES): a record of exactly what this rank trained on."""

    def __init__(self, batches, indices: list[int], batch_size: int, path: Path, epoch: int):
        self.batches, self.indices, self.batch_size = batches, indices, batch_size
        self.path, self.epoch = path, epoch

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        with open(self.path, "a") as handle:
            for position, batch in enumerate(self.batches):
                start = position * self.batch_size
                chunk = self.indices[start : start + self.batch_size]
                handle.write(json.dumps({"epoch": self.epoch, "indices": chunk}) + "\n")
                handle.flush()
                yield batch


# --- What the training loop sees ---------------------------------------------------------


class DataPipeline:
    """Train and validation batches for this rank, whichever path they come from."""

    def __init__(self, splits: Splits, cfg, ctx: DistContext, use_device_path: bool):
        self.splits = splits
        self.cfg = cfg
        self.ctx = ctx
        self.channels_last = ctx.device.type == "cuda"
        in_memory = splits.train is not None
        self.on_device = use_device_path and in_memory
        if cfg.dataset == "imagefolder":
            self.mean, self.std = IMAGENET_MEAN, IMAGENET_STD
        else:
            self.mean, self.std = channel_stats(splits.train.images)
        self.workers = (
            cfg.workers if cfg.workers is not None else default_workers(ctx.local_world_size)
        )
        trace = cfg.trace_samples
        self.trace_file = trace.with_name(f"{trace.name}.rank{ctx.rank}") if trace else None
        if self.on_device:
            self._hold_on_device(splits)
        else:
            self._start_loaders(splits, in_memory)

    def _hold_on_device(self, splits: Splits) -> None:
        # The uint8 set lives where it is augmented; batches never cross PCIe.
        device = self.ctx.device
        self.train_set = ImageSet(splits.train.images.to(device), splits.train.labels)
        self.val_set = ImageSet(splits.val.images.to(device), splits.val.labels)
        self.train_size, self.val_size = len(splits.train), len(splits.val)

    def _start_loaders(self, splits: Splits, in_memory: bool) -> None:
        seed = self.cfg.seed
        if in_memory:
            train = MemoryDataset(splits.train, seed, augment=True)
            val = MemoryDataset(splits.val, seed, augment=False)
        else:
            size, classes = self.cfg.image_size, splits.class_names
            train = FolderDataset(splits.train_dir, classes, size, seed, augment=True)
            val = FolderDataset(splits.val_dir, classes, size, seed, augment=False)
        self.train_size, self.val_size = len(train), len(val)
        self.train_loader, self.val_loader = self._loader(train), self._loader(val)

    def _loader(self, dataset) -> LoaderBatches:
        return LoaderBatches(
            dataset, self.cfg.per_gpu_batch, self.ctx.device, self.mean, self.std, self.workers,
            self.channels_last,
        )  # fmt: skip

    @property
    def path_name(self) -> str:
        return "device" if self.on_device else f"loader ({self.workers} workers)"

    def steps_per_epoch(self) -> int:
        per_rank = math.ceil(self.train_size / self.ctx.world_size)
        return math.ceil(per_rank / self.cfg.per_gpu_batch)

    def train_batches(self, epoch: int, skip_batches: int = 0):
        """The epoch's order depends only on seed and epoch; a resume skips by position."""
        indices = train_shard(self.train_size, self.ctx, self.cfg.seed, epoch)
        indices = indices[skip_batches * self.cfg.per_gpu_batch :]
        if self.on_device:
            batches = self._device_batches(self.train_set, indices, augment=True, epoch=epoch)
        else:
            batches = self.train_loader.for_epoch(indices, epoch)
        if self.trace_file:
            return TracedBatches(batches, indices, self.cfg.per_gpu_batch, self.trace_file, epoch)
        return batches

    def val_batches(self):
        indices = val_shard(self.val_size, self.ctx)
        if self.on_device:
            return self._device_batches(self.val_set, indices, augment=False, epoch=0)
        return self.val_loader.for_epoch(indices, 0)

    def _device_batches(self, image_set: ImageSet, indices, augment: bool, epoch: int):
        return TensorBatches(
            image_set, indices, self.cfg.per_gpu_batch, self.ctx.device, self.mean, self.std,
            augment, self.cfg.seed, epoch, self.channels_last,
        )  # fmt: skip


def load_splits(cfg, ctx: DistContext, in_memory: bool) -> Splits:
    if cfg.dataset == "synthetic":
        return synthetic_splits(cfg.synthetic_size, cfg.image_size, cfg.seed)
    if cfg.dataset == "stl10":
        splits = stl10_splits(cfg.data_dir, cfg.download, ctx)
        if cfg.image_size != STL10_SIDE:
            splits.train = resize_set(splits.train, cfg.image_size)
            splits.val = resize_set(splits.val, cfg.image_size)
        return splits
    cache_dir = cfg.out / "cache"
    return imagefolder_splits(cfg.data_dir, cfg.image_size, in_memory, cache_dir, ctx)


def resize_set(image_set: ImageSet, image_size: int) -> ImageSet:
    resized = F.interpolate(
        image_set.images.float(), size=image_size, mode="bilinear", antialias=True
    )
    return ImageSet(resized.round().clamp(0, 255).to(torch.uint8), image_set.labels)
