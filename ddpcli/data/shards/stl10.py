"""STL-10's binary layout read for packing, without torch: labels and class names checked,
and each image encoded losslessly as PNG (the layout holds raw pixels, not image files)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from ddpcli.data.layout import STL10_SIDE
from ddpcli.errors import usage_error

IMAGE_BYTES = 3 * STL10_SIDE * STL10_SIDE
CLASSES = 10


def class_names(binary: Path) -> list[str]:
    """`class_names.txt`'s ten names, as `ddpcli train --dataset stl10` reads them."""
    names_file = binary / "class_names.txt"
    names = names_file.read_text().split() if names_file.is_file() else []
    return names if len(names) == CLASSES else [f"class{i}" for i in range(CLASSES)]


def labels(binary: Path, split: str) -> list[int]:
    """SPLIT's labels, 0-based, one per image of SPLIT_X.bin; exit 2 if the files disagree."""
    images_path, labels_path = binary / f"{split}_X.bin", binary / f"{split}_y.bin"
    size = images_path.stat().st_size
    if size == 0 or size % IMAGE_BYTES:
        raise usage_error(
            f"{images_path} is truncated or not STL-10 ({size} bytes is not a multiple of "
            f"{IMAGE_BYTES}); fetch it again (ddpcli train --dataset stl10 --download)"
        )
    found = np.fromfile(labels_path, dtype=np.uint8).astype(np.int64) - 1
    if len(found) != size // IMAGE_BYTES:
        raise usage_error(f"{labels_path} has {len(found)} labels for {size // IMAGE_BYTES} images")
    if found.min() < 0 or found.max() >= CLASSES:
        raise usage_error(f"{labels_path} holds labels outside 1..10: not STL-10")
    return [int(label) for label in found]


def png_bytes(images_path: Path, number: int) -> bytes:
    """Image NUMBER as a PNG: channel-major in the file, each channel column-major."""
    from PIL import Image

    with open(images_path, "rb") as handle:
        handle.seek(number * IMAGE_BYTES)
        raw = handle.read(IMAGE_BYTES)
    channels = np.frombuffer(raw, dtype=np.uint8).reshape(3, STL10_SIDE, STL10_SIDE)
    pixels = np.ascontiguousarray(channels.transpose(2, 1, 0))  # (row, column, channel)
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, format="PNG")
    return encoded.getvalue()
