"""STL-10's images for packing, without torch: each encoded losslessly as PNG (the layout
holds raw pixels, not image files). Labels and class names are read as `ddpcli train`
reads them (ddpcli.data.layout)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from ddpcli.data.layout import STL10_IMAGE_BYTES, STL10_SIDE


def png_bytes(images_path: Path, number: int) -> bytes:
    """Image NUMBER as a PNG: channel-major in the file, each channel column-major."""
    from PIL import Image

    with open(images_path, "rb") as handle:
        handle.seek(number * STL10_IMAGE_BYTES)
        raw = handle.read(STL10_IMAGE_BYTES)
    channels = np.frombuffer(raw, dtype=np.uint8).reshape(3, STL10_SIDE, STL10_SIDE)
    pixels = np.ascontiguousarray(channels.transpose(2, 1, 0))  # (row, column, channel)
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, format="PNG")
    return encoded.getvalue()
