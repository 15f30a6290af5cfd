"""What the launcher decides and checks about the data before any worker starts, without
importing torch (a wrong --data-dir is answered in a fraction of a second): the folders
each data set needs (STL-10's binary files, an ImageNet-style class tree), the sides images
are validated at, and what `--augment auto` means for each set.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from ddpcli.config import TrainConfig
from ddpcli.errors import DdpcliError, usage_error
from ddpcli.factories import is_factory_spec

Augment = Literal["rrc", "crop-flip", "none"]
Sample = tuple[Path, int]  # an image file and its label

STL10_SIDE = 96
STL10_IMAGE_BYTES = 3 * STL10_SIDE * STL10_SIDE
STL10_CLASSES = 10
# torchvision's ImageFolder extensions, compared case-insensitively.
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".webp", ".tif", ".tiff"}


def training_augment(choice: str, dataset: str) -> Augment:
    """`--augment auto`: the random-resized crop for image folders, shards and the user's own
    sets (photos of any size, as torchvision's and timm's references treat them), the padded
    crop and flip for the small in-memory sets (synthetic, STL-10)."""
    if choice == "auto":
        photos = dataset in ("imagefolder", "shards") or is_factory_spec(dataset)
        return "rrc" if photos else "crop-flip"
    if choice not in ("rrc", "crop-flip", "none"):
        raise ValueError(f"unknown augmentation {choice!r}")
    return choice  # type: ignore[return-value]  # checked just above


# --- STL-10 -----------------------------------------------------------------------------


def stl10_dir(data_dir: Path) -> Path:
    return data_dir / "stl10_binary"


def stl10_present(data_dir: Path) -> bool:
    folder = stl10_dir(data_dir)
    names = ("train_X.bin", "train_y.bin", "test_X.bin", "test_y.bin")
    return all((folder / name).is_file() for name in names)


def stl10_class_names(folder: Path) -> list[str]:
    """`class_names.txt`'s ten names, or class0..class9 where it is missing or wrong."""
    names_file = folder / "class_names.txt"
    names = names_file.read_text().split() if names_file.is_file() else []
    return names if len(names) == STL10_CLASSES else [f"class{i}" for i in range(STL10_CLASSES)]


def stl10_labels(folder: Path, split: str) -> list[int]:
    """SPLIT's labels, 0-based, one per image of SPLIT_X.bin (the official binary layout:
    labels are bytes 1..10); exit 2 if the files are truncated or disagree."""
    import numpy as np  # here: --help and a wrong --data-dir are answered without numpy

    images_path, labels_path = folder / f"{split}_X.bin", folder / f"{split}_y.bin"
    size = images_path.stat().st_size
    if size == 0 or size % STL10_IMAGE_BYTES:
        raise usage_error(
            f"{images_path} is truncated or not STL-10 ({size} bytes is not a multiple of "
            f"{STL10_IMAGE_BYTES}); delete it and fetch it again (ddpcli train --dataset stl10 "
            "--download)"
        )
    labels = np.fromfile(labels_path, dtype=np.uint8).astype(np.int64) - 1
    if len(labels) != size // STL10_IMAGE_BYTES:
        raise usage_error(
            f"{labels_path} has {len(labels)} labels for {size // STL10_IMAGE_BYTES} images"
        )
    if labels.min() < 0 or labels.max() >= STL10_CLASSES:
        raise usage_error(f"{labels_path} holds labels outside 1..10: not STL-10")
    return labels.tolist()


# --- Image folders (ImageNet layout) ----------------------------------------------------


def hidden(name: str) -> bool:
    """`.ipynb_checkpoints/`, `.git/`, macOS's `._photo.jpg`: never a class, never an image.
    (torchvision's ImageFolder takes hidden folders for classes.)"""
    return name.startswith(".")


def folder_classes(split_dir: Path) -> list[str]:
    return sorted(
        entry.name for entry in split_dir.iterdir() if entry.is_dir() and not hidden(entry.name)
    )


def is_image_name(name: str) -> bool:
    return not hidden(name) and Path(name).suffix.lower() in IMAGE_SUFFIXES


def images_under(folder: Path) -> Iterator[Path]:
    """The image files in FOLDER and its sub-folders, hidden ones left out, as found (not
    sorted): a caller that stops at the first reads no more of the folder."""
    for root, folders, files in os.walk(folder, followlinks=True):
        folders[:] = [name for name in folders if not hidden(name)]
        yield from (Path(root, name) for name in files if is_image_name(name))


def folder_samples(split_dir: Path, classes: list[str]) -> list[Sample]:
    samples: list[Sample] = []
    for label, name in enumerate(classes):
        class_dir = split_dir / name
        if class_dir.is_dir():
            samples.extend((path, label) for path in sorted(images_under(class_dir)))
    return samples


def holds_images(folder: Path) -> bool:
    """Stops at the first image: cheap on a folder of any size."""
    return folder.is_dir() and next(images_under(folder), None) is not None


def listed(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(map(shown_name, names[:limit])) + more


def shown_name(name: str) -> str:
    """A name (a class folder's, a file's) as a line shows it: quoted with its escapes when it
    holds a newline or another character that would split the line or hide in it."""
    return name if name.isprintable() else repr(name)


def check_imagefolder(data_dir: Path) -> list[str]:
    """Fail early, before any process starts, unless the layout is train/<class>/* and
    val/<class>/*, every train class holds an image, val holds images and names no class that
    train lacks (the model would have no label for them), and no image lies outside a class
    folder. Each check stops at the first image it finds: no folder is listed in full here."""
    suffixes = ", ".join(sorted(IMAGE_SUFFIXES))
    for split in ("train", "val"):
        split_dir = data_dir / split
        if not split_dir.is_dir():
            raise usage_error(
                f"{split_dir} is missing: --dataset imagefolder expects "
                "DATA_DIR/train/<class>/*.jpg and DATA_DIR/val/<class>/*.jpg"
            )
        loose = sorted(
            entry.name
            for entry in split_dir.iterdir()
            if is_image_name(entry.name) and entry.is_file()
        )
        if loose:
            raise usage_error(
                f"{split_dir} holds images outside any class folder ({listed(loose)}); "
                f"move each into {split}/<class>/"
            )
    train_dir, val_dir = data_dir / "train", data_dir / "val"
    classes = folder_classes(train_dir)
    if len(classes) < 2:
        raise usage_error(f"{train_dir} needs at least two class folders")
    empty = [name for name in classes if not holds_images(train_dir / name)]
    if empty:
        raise usage_error(
            f"{train_dir} has class folders with no images: {listed(empty)}; add images "
            f"({suffixes}) or remove those folders"
        )
    unknown = sorted(set(folder_classes(val_dir)) - set(classes))
    if unknown:
        raise usage_error(
            f"{val_dir} has class folders that train lacks: {listed(unknown)}; the model has "
            f"no label for them: add them to {train_dir} or move them out of val"
        )
    if not any(holds_images(val_dir / name) for name in classes):
        raise usage_error(f"{val_dir} holds no images in its class folders ({suffixes})")
    return classes


# Validation as torchvision's reference recipe: shorter side to image_size / 0.875 (256 for
# 224), then the centre crop at image_size.
CENTRE_CROP_FRACTION = 0.875


def resize_side(image_size: int) -> int:
    return round(image_size / CENTRE_CROP_FRACTION)


def stl10_missing(data_dir: Path) -> DdpcliError:
    return usage_error(
        f"STL-10 not found in {stl10_dir(data_dir)}; pass --download to fetch it (2.6 GB) "
        "or point --data-dir at the folder that holds stl10_binary/"
    )


def check_data_source(cfg: TrainConfig) -> None:
    """The data set named by the flags is there (or can be fetched): exit 2 otherwise."""
    # The user's own factory reads --data-dir as it likes (a folder, a CSV file, nothing).
    if cfg.dataset == "synthetic" or cfg.custom_dataset or cfg.data_dir is None:
        return
    if not isinstance(cfg.data_dir, Path):  # a URL, which only shards are read from
        from ddpcli.data.shards.checks import check_shard_source

        check_shard_source(cfg.data_dir)
        return
    if not cfg.data_dir.is_dir() and not (cfg.dataset == "stl10" and cfg.download):
        hint = "; add --download to fetch STL-10 into it" if cfg.dataset == "stl10" else ""
        raise usage_error(
            f"invalid --data-dir: {cfg.data_dir} does not exist or is not a folder{hint}"
        )
    if cfg.dataset == "stl10" and not cfg.download and not stl10_present(cfg.data_dir):
        raise stl10_missing(cfg.data_dir)
    if cfg.dataset == "imagefolder":
        check_imagefolder(cfg.data_dir)
    if cfg.dataset == "shards":
        from ddpcli.data.shards.checks import check_shard_source

        check_shard_source(cfg.data_dir)
