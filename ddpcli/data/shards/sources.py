"""What `ddpcli data pack` reads: an image folder (`train/<class>/*`, `val/<class>/*`, the
classes found as `--dataset imagefolder` finds them) or STL-10's binary layout, listed as
samples with a stable key each, in a seeded order, planned into shards of about a size."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path, PurePath
from urllib.parse import quote

from ddpcli.data.layout import (
    STL10_IMAGE_BYTES,
    check_imagefolder,
    folder_samples,
    stl10_class_names,
    stl10_dir,
    stl10_labels,
    stl10_present,
)
from ddpcli.errors import DdpcliError, usage_error

TAR_BLOCK = 512


@dataclass(frozen=True)
class PackItem:
    """One sample to pack: KEY.SUFFIX holds the bytes of PATH (STL-10: image number
    STL10_INDEX of the binary file PATH, encoded as PNG), KEY.cls its LABEL."""

    key: str
    label: int
    path: str
    suffix: str
    size: int  # the file's bytes, or STL-10's raw pixels: what plans the shards
    stl10_index: int = -1


@dataclass
class SplitSource:
    classes: list[str]
    items: list[PackItem]


@dataclass
class Source:
    kind: str  # "imagefolder" or "stl10"
    splits: dict[str, SplitSource]


def sample_key(relative: PurePath) -> str:
    """A webdataset key from a file's path under SRC: `train/cat/img001.jpg` becomes
    `train/cat/img001`. webdataset splits a member's name at the first dot of its base name,
    so each part is percent-escaped and its dots too (`a.b` -> `a%2Eb`), which keeps two
    different paths two different keys."""
    parts = [*relative.parent.parts, relative.stem]
    # surrogateescape: a name that is not UTF-8 keeps its own bytes, escaped.
    escaped = (quote(part, safe="", errors="surrogateescape") for part in parts)
    return "/".join(part.replace(".", "%2E") for part in escaped)


def stl10_binary(src: Path) -> Path | None:
    """The folder of STL-10's binary files when SRC is STL-10 (it, or the folder holding it)."""
    binary = src if src.name == "stl10_binary" else stl10_dir(src)
    return binary if stl10_present(binary.parent) else None


def source_folder(src: Path) -> Path:
    """The folder the samples are read from: SRC, or for STL-10 its stl10_binary/."""
    return stl10_binary(src) or src


def find_source(src: Path) -> Source:
    """SRC's samples, or exit 2 saying what SRC should be."""
    if not src.is_dir():
        raise usage_error(f"invalid SRC: {src} does not exist or is not a folder")
    binary = stl10_binary(src)
    if binary is not None:
        return stl10_source(binary)
    if (src / "train").is_dir():
        return imagefolder_source(src)
    raise usage_error(
        f"invalid SRC: {src} is neither an image folder (SRC/train/<class>/*, "
        "SRC/val/<class>/*) nor STL-10 (SRC/stl10_binary/train_X.bin, ...)"
    )


def imagefolder_source(src: Path) -> Source:
    classes = check_imagefolder(src)
    splits = {}
    for split in ("train", "val"):
        items = [
            PackItem(
                key=sample_key(path.relative_to(src)),
                label=label,
                path=str(path),
                suffix=path.suffix.lower().lstrip("."),
                size=file_size(path),
            )
            for path, label in folder_samples(src / split, classes)
        ]
        check_unique_keys(items, src)
        splits[split] = SplitSource(classes, items)
    return Source("imagefolder", splits)


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as error:
        raise unreadable_source(path, error) from None


def unreadable_source(path: Path, error: OSError) -> DdpcliError:
    """A file of SRC that cannot be read (a link to nothing, no permission): exit 2, naming
    it, as `ddpcli train` names an image it cannot read."""
    reason = error.strerror or str(error)
    if path.is_symlink() and not path.exists():
        reason = f"a symbolic link to {os.readlink(path)}, which does not exist"
    return usage_error(f"cannot read {path}: {reason}; fix or delete it, then pack again")


def check_unique_keys(items: list[PackItem], src: Path) -> None:
    """`cat/a.jpg` beside `cat/a.png` would be one sample of two images to a reader."""
    seen: dict[str, PackItem] = {}
    for item in items:
        other = seen.setdefault(item.key, item)
        if other is not item:
            first, second = (Path(path).relative_to(src) for path in (other.path, item.path))
            raise usage_error(
                f"{first} and {second} would be one sample (key {item.key}): a shard keeps "
                "one image per name; rename one of them"
            )


def stl10_source(binary: Path) -> Source:
    """STL-10's train split, and its test split as `val` (as `ddpcli train` uses it)."""
    classes = stl10_class_names(binary)
    splits = {}
    for split, source_split in (("train", "train"), ("val", "test")):
        labels = stl10_labels(binary, source_split)
        images = binary / f"{source_split}_X.bin"
        items = [
            PackItem(
                key=f"{split}/{number:06d}",
                label=label,
                path=str(images),
                suffix="png",
                size=STL10_IMAGE_BYTES,
                stl10_index=number,
            )
            for number, label in enumerate(labels)
        ]
        splits[split] = SplitSource(classes, items)
    return Source("stl10", splits)


def seeded_order(items: list[PackItem], seed: int) -> list[PackItem]:
    """Sorted by key, then shuffled with SEED: the same every time, and each shard holds a
    mix of classes (a class-sorted shard would hold one or two of them, which no shuffle
    buffer of a reader could undo)."""
    ordered = sorted(items, key=lambda item: item.key)
    random.Random(seed).shuffle(ordered)
    return ordered


def tar_bytes(item: PackItem) -> int:
    """What ITEM adds to a tar: a header and the padded data, and the same for KEY.cls."""
    padded = -(-item.size // TAR_BLOCK) * TAR_BLOCK
    return TAR_BLOCK + padded + 2 * TAR_BLOCK


def plan_shards(items: list[PackItem], shard_bytes: int) -> list[list[PackItem]]:
    """Consecutive runs of ITEMS, each about SHARD_BYTES in the tar (a sample larger than
    that gets a shard of its own)."""
    shards: list[list[PackItem]] = []
    current: list[PackItem] = []
    filled = 0
    for item in items:
        size = tar_bytes(item)
        if current and filled + size > shard_bytes:
            shards.append(current)
            current, filled = [], 0
        current.append(item)
        filled += size
    if current:
        shards.append(current)
    return shards
