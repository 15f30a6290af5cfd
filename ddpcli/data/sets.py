"""The data sets, read into memory or listed for streaming: the synthetic set, STL-10 (the
official binary layout, own reader; torchvision only downloads it) and ImageNet-layout
folders; and the checks that run before any worker starts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import numpy as np
import torch
import torch.nn.functional as F

from ddpcli.config import TrainConfig
from ddpcli.dist import DistContext, zero_first
from ddpcli.errors import usage_error
from ddpcli.files import atomic_save

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
class MemorySplits:
    """Train and validation splits held in memory."""

    train: ImageSet
    val: ImageSet
    num_classes: int
    class_names: list[str]


@dataclass
class FolderSplits:
    """An image folder's train and validation folders, streamed by the loader's workers."""

    train_dir: Path
    val_dir: Path
    num_classes: int
    class_names: list[str]


Splits: TypeAlias = MemorySplits | FolderSplits


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


def stl10_splits(data_dir: Path, download: bool, ctx: DistContext) -> MemorySplits:
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
    train, val = read_stl10_split(folder, "train"), read_stl10_split(folder, "test")
    return MemorySplits(train, val, 10, names)


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
    data_dir: Path, image_size: int, decode_once: bool, cache_dir: Path, ctx: DistContext
) -> Splits:
    classes = check_imagefolder(data_dir)
    if not decode_once:  # the loader's workers decode each image as it is needed
        return FolderSplits(data_dir / "train", data_dir / "val", len(classes), classes)
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
    return MemorySplits(train, val, len(classes), classes)


def read_rgb(path: Path) -> torch.Tensor:
    """uint8 (3, H, W). PIL decodes: torchvision.io's decoders are deprecated from 0.29."""
    from PIL import Image
    from torchvision.transforms.v2.functional import pil_to_tensor

    with Image.open(path) as image:
        return pil_to_tensor(image.convert("RGB"))


def resize_set(image_set: ImageSet, image_size: int) -> ImageSet:
    resized = F.interpolate(
        image_set.images.float(), size=image_size, mode="bilinear", antialias=True
    )
    return ImageSet(resized.round().clamp(0, 255).to(torch.uint8), image_set.labels)


# --- Loading and checking, as the run asks ------------------------------------------


def load_splits(cfg: TrainConfig, ctx: DistContext, device_resident: bool) -> Splits:
    """The splits in memory; an image folder only listed unless it will be device-resident."""
    image_size = cfg.resolved_image_size
    if cfg.dataset == "synthetic":
        return synthetic_splits(cfg.synthetic_size, image_size, cfg.seed)
    if cfg.dataset == "stl10":
        splits = stl10_splits(cfg.resolved_data_dir, cfg.download, ctx)
        if image_size != STL10_SIDE:
            splits.train = resize_set(splits.train, image_size)
            splits.val = resize_set(splits.val, image_size)
        return splits
    cache_dir = cfg.resolved_out / "cache"
    return imagefolder_splits(cfg.resolved_data_dir, image_size, device_resident, cache_dir, ctx)


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
