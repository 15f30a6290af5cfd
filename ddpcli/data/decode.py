"""Image files to uint8 pixels, as torchvision's ImageFolder reads them (PIL, then RGB),
and the loader path's faster twins: JPEGs decoded at a reduced scale when the pixels are
downsampled anyway.

libjpeg can decode at 1/2, 1/4 or 1/8 of the size (PIL's `draft`): it skips most of the
inverse DCT and the colour conversion, the bulk of a decode. An ImageNet-sized photo
(about 500x375) cropped at random and resized to 64 or 224 px rarely needs every pixel:
the decoder is asked for the smallest scale that still leaves the crop at least as large
as the output, so the resize that follows still only shrinks (antialiased), and the
pixels stay within interpolation tolerance of a full decode.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ddpcli.errors import USAGE, DdpcliError, first_line

if TYPE_CHECKING:
    from collections.abc import Callable

    from PIL.Image import Image

    from ddpcli.data.augment import CropBox

    CropBoxFor = Callable[[int, int], CropBox]  # (stored height, width) -> the box drawn


class UnreadableImage(DdpcliError):
    """An image file that cannot be decoded: exit 2 (bad input), naming the file.

    Raised in a DataLoader worker, it reaches the training process re-created from the
    worker's formatted traceback, whose last line is `ddpcli.data.decode.UnreadableImage:
    <message>`; only that message is kept, so the user still reads one line."""

    def __init__(self, message: str) -> None:
        last = (message.strip().splitlines() or [message])[-1]
        super().__init__(last.split(f"{UnreadableImage.__name__}: ", 1)[-1], USAGE)


@contextlib.contextmanager
def opened(path: Path) -> Iterator[Image]:
    """PATH opened by PIL; any failure to read or decode it (also while the caller decodes)
    becomes UnreadableImage, naming the file."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            yield image
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as error:
        reason = (
            "not an image file PIL can read"
            if isinstance(error, Image.UnidentifiedImageError)
            else first_line(error)
        )
        raise UnreadableImage(
            f"cannot decode image {path}: {reason}; fix or delete the file, or pass "
            "--skip-bad-images to leave such files out"
        ) from None


def as_rgb(image: Image) -> Image:
    """Every mode becomes RGB as torchvision's ImageFolder makes it (PIL's `convert("RGB")`):
    grey repeated, CMYK converted without a colour profile, alpha (RGBA, LA, a palette's
    transparency) dropped, not composited. A palette with transparency goes through RGBA,
    which gives the same pixels without PIL's warning. An RGB image is used as it is
    (convert would copy it). Grey deeper than 8 bits is scaled from its own range, where
    PIL would clip it at 255 (`as_8_bit_grey`)."""
    if image.mode == "RGB":
        image.load()
        return image
    if image.mode == "P" and "transparency" in image.info:
        return image.convert("RGBA").convert("RGB")
    if image.mode in WIDE_GREY_MODES:
        return as_8_bit_grey(image).convert("RGB")
    return image.convert("RGB")


# 16-bit grey (PNG, TIFF: I;16 and its byte orders), and PIL's 32-bit integer and float grey.
WIDE_GREY_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")
SIXTEEN_BIT_MAX = 65535


def as_8_bit_grey(image: Image) -> Image:
    """Mode L from a grey image deeper than 8 bits. PIL's own conversion clips at 255, so a
    16-bit image turned white: 16-bit pixels are scaled from 0..65535 instead. I and F hold
    no depth of their own: values within 0..255 are taken as PIL takes them, integers up to
    65535 as 16 bits (older Pillow opens 16-bit PNGs as I); anything else is refused
    (ValueError: `opened` names the file), never clipped."""
    import numpy as np
    from PIL import Image as PILImage

    values = np.asarray(image)  # PIL's getextrema does not take I;16B
    low, high = values.min().item(), values.max().item()
    sixteen_bits = image.mode.startswith("I;16") or (image.mode == "I" and high > 255)
    top = SIXTEEN_BIT_MAX if sixteen_bits else 255
    if low < 0 or high > top:
        raise ValueError(
            f"its {image.mode} pixels run from {low:g} to {high:g}, outside 0..{top}; save it "
            "with 8 or 16 bits per channel"
        )
    if not sixteen_bits:
        return image.convert("L")
    wide = values.astype(np.uint32)
    scaled = (wide * 255 + SIXTEEN_BIT_MAX // 2) // SIXTEEN_BIT_MAX  # rounded to nearest
    return PILImage.fromarray(scaled.astype(np.uint8))  # 2-D uint8: mode L


def to_tensor(image: Image) -> torch.Tensor:
    from torchvision.transforms.v2.functional import pil_to_tensor

    return pil_to_tensor(image)


def read_rgb(path: Path) -> torch.Tensor:
    """uint8 (3, H, W), every pixel. PIL decodes: torchvision.io's decoders are deprecated
    from 0.29."""
    with opened(path) as image:
        return to_tensor(as_rgb(image))


def reduce_while_decoding(image: Image, width: int, height: int) -> int:
    """Let a JPEG decode at the smallest scale that keeps it at least WIDTH x HEIGHT; the
    factor it took (1, 2, 4 or 8; 1 for other formats)."""
    full_width = image.size[0]
    image.draft(None, (max(1, width), max(1, height)))  # a no-op for formats other than JPEG
    return max(1, round(full_width / image.size[0]))


def read_rgb_at_least(path: Path, side: int) -> torch.Tensor:
    """uint8 (3, H, W) with the shorter side at least SIDE where the file allows (a JPEG may
    decode smaller than stored): for views that resize the shorter side to SIDE."""
    with opened(path) as image:
        width, height = image.size
        scale = side / max(1, min(width, height))
        reduce_while_decoding(image, math.ceil(width * scale), math.ceil(height * scale))
        return to_tensor(as_rgb(image))


def read_resized_crop(path: Path, box_for: CropBoxFor, size: int) -> torch.Tensor:
    """uint8 (3, SIZE, SIZE): the box that BOX_FOR draws from the image's stored (height,
    width), cut and resized (bilinear, antialiased: PIL's uint8 resampler, the one
    torchvision's antialiased resize reproduces) and mirrored if drawn so. The JPEG decodes
    at the smallest scale that leaves the box at least SIZE on each side."""
    from PIL import Image as PILImage

    with opened(path) as image:
        width, height = image.size
        box = box_for(height, width)
        reduce = reduce_while_decoding(
            image, math.ceil(width * size / box.width), math.ceil(height * size / box.height)
        )
        region = (  # the box in the decoded pixels: a reduced pixel covers REDUCE stored ones
            box.left / reduce,
            box.top / reduce,
            (box.left + box.width) / reduce,
            (box.top + box.height) / reduce,
        )
        crop = as_rgb(image).resize((size, size), PILImage.Resampling.BILINEAR, box=region)
    pixels = to_tensor(crop)
    return pixels.flip(2) if box.flip else pixels
