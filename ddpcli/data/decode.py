"""Image files to uint8 pixels, as torchvision's ImageFolder reads them (PIL, then RGB),
and the loader path's faster twins for JPEGs, whose pixels are resized anyway.

A JPEG's decode is most of an image's cost in a loader worker, so the loader's readers take
one of two shortcuts, both through libjpeg-turbo:
- Reduced scale. libjpeg can decode at 1/2, 1/4 or 1/8 of the size (PIL's `draft`): it skips
  most of the inverse DCT and the colour conversion. The box a crop cuts is drawn first, from
  the size stored in the file, then the decoder is asked for the smallest scale that still
  leaves the box at least as large as the output on each side (`dct_reduction`), so the
  resize that follows still only shrinks (antialiased), and the pixels stay within
  interpolation tolerance of a full decode. An ImageNet-sized photo (about 500x375) cropped
  at random and resized to 64 px rarely needs every pixel. Neither PIL nor torchvision
  exposes libjpeg's finer scales (5/8 to 7/8) or its row skipping.
- Full scale, straight into a tensor. Where no reduced scale keeps enough pixels (most
  224 px crops), the size is read from the JPEG's frame header (`straight_jpeg_size`: PIL's
  opening of the file cost about a tenth of the image's time) and libjpeg-turbo decodes
  through torchvision's `decode_jpeg` op, the same library and settings as PIL's, so the
  same pixels, without PIL's 4-byte-per-pixel image and its copy into a tensor; the pixels
  stay interleaved (channels last), which is the layout torch's vectorised uint8
  antialiased resize reads. torchvision deprecates its decoders from 0.29: where they are
  gone, PIL decodes instead (same pixels, slower).
The box is drawn from the stored size either way: a seed means the same crops.
"""

from __future__ import annotations

import contextlib
import functools
import io
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, NamedTuple

import torch

from ddpcli.errors import USAGE, DdpcliError, first_line

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
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


class EncodedImage(NamedTuple):
    """An image file's bytes held in memory (a shard's member), and the name an error reports
    it by (`shard:key`)."""

    name: str
    data: bytes


# An image file: its path, its bytes, or a binary file object whose str() names it.
ImageSource = Path | EncodedImage | BinaryIO


def encoded(source: ImageSource) -> EncodedImage:
    """SOURCE's bytes, read whole (PIL parses the header from them, libjpeg the rest), and
    the name an error reports it by."""
    if isinstance(source, EncodedImage):
        return source
    if isinstance(source, io.BytesIO):
        return EncodedImage(str(source), source.getvalue())
    if hasattr(source, "read"):
        return EncodedImage(str(source), source.read())
    return EncodedImage(str(source), Path(source).read_bytes())


def source_name(source: ImageSource) -> str:
    return source.name if isinstance(source, EncodedImage) else str(source)


@contextlib.contextmanager
def named_failures(name: str) -> Iterator[None]:
    """Any failure to read or decode the image file NAME becomes UnreadableImage, naming it."""
    from PIL import Image

    try:
        yield
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as error:
        reason = (
            "not an image file PIL can read"
            if isinstance(error, Image.UnidentifiedImageError)
            else first_line(error)
        )
        raise UnreadableImage(
            f"cannot decode image {name}: {reason}; fix or delete the file, or pass "
            "--skip-bad-images to leave such files out"
        ) from None


@contextlib.contextmanager
def opened(source: ImageSource) -> Iterator[Image]:
    """SOURCE opened by PIL (its header read); any failure to read or decode it (also while
    the caller decodes) becomes UnreadableImage, naming the file."""
    from PIL import Image

    with named_failures(source_name(source)), Image.open(io.BytesIO(encoded(source).data)) as image:
        yield image


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


def read_rgb(source: ImageSource) -> torch.Tensor:
    """uint8 (3, H, W), every pixel, as ImageFolder reads them (PIL decodes: this feeds the
    caches and --skip-bad-images' threads, where PIL lets go of the GIL)."""
    with opened(source) as image:
        return to_tensor(as_rgb(image))


@functools.cache
def libjpeg_decoder() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torchvision's libjpeg-turbo decoder to RGB, or None where it is gone (deprecated from
    torchvision 0.29) or its image extension did not load: tried once on a tiny JPEG. The op
    itself, not `torchvision.io.decode_jpeg`, whose deprecation warning and usage logging
    cost 40 us a call (a 224 px crop takes about 2 ms)."""
    from PIL import Image

    try:
        import torchvision.io  # registers the image ops

        decoder = functools.partial(
            torch.ops.image.decode_jpeg, mode=torchvision.io.ImageReadMode.RGB.value
        )
        sample = io.BytesIO()
        Image.new("RGB", (16, 8), (200, 100, 50)).save(sample, "JPEG")
        decoded = decoder(torch.frombuffer(bytearray(sample.getvalue()), dtype=torch.uint8))
    except (ImportError, AttributeError, RuntimeError, TypeError):
        return None
    return decoder if decoded.shape == (3, 8, 16) else None


# Start-of-frame markers (the frame header holds the stored size): all of them, and those
# of the Huffman-coded frames PIL and torchvision both read with libjpeg's default settings.
FRAME_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # not DHT, JPG, DAC
HUFFMAN_FRAMES = (0xC0, 0xC1, 0xC2)  # baseline, extended sequential, progressive
BASELINE_FRAME = 0xC0


class JpegFrame(NamedTuple):
    """What a JPEG's frame header says: the stored size, the components (1 grey, 3 colour,
    4 CMYK), the bits per sample, and its start-of-frame marker: Huffman-coded (baseline,
    extended or progressive: what libjpeg's default settings and nvjpeg read) or not."""

    height: int
    width: int
    components: int
    precision: int
    marker: int

    @property
    def huffman(self) -> bool:
        return self.marker in HUFFMAN_FRAMES

    @property
    def baseline(self) -> bool:
        """Baseline sequential: what a GPU's hardware JPEG decoder takes in batches."""
        return self.marker == BASELINE_FRAME

    def within_bomb_limit(self) -> bool:
        from PIL import Image

        limit = Image.MAX_IMAGE_PIXELS
        return limit is None or self.height * self.width <= limit

    def straight(self) -> bool:
        """8-bit colour, Huffman-coded, of a size and within PIL's decompression-bomb
        limit: libjpeg-turbo's RGB output is then PIL's (grey and CMYK go through PIL)."""
        usable = self.height > 0 and self.width > 0 and self.within_bomb_limit()
        return usable and self.huffman and self.precision == 8 and self.components == 3


def jpeg_frame(data: bytes) -> JpegFrame | None:
    """DATA's frame header, or None where DATA is no JPEG or its header is cut short."""
    if not data.startswith(b"\xff\xd8"):
        return None
    position = 2
    while position + 10 <= len(data) and data[position] == 0xFF:
        marker = data[position + 1]
        if marker == 0xFF:  # a fill byte before a marker
            position += 1
        elif marker in FRAME_MARKERS:
            precision, height, width, components = struct.unpack_from(">BHHB", data, position + 4)
            return JpegFrame(height, width, components, precision, marker)
        else:  # APPn, DQT, DHT...: skip the segment by its length
            position += 2 + int.from_bytes(data[position + 2 : position + 4], "big")
    return None


def straight_jpeg_size(data: bytes) -> tuple[int, int] | None:
    """The stored (height, width) of a JPEG that libjpeg-turbo may decode straight into a
    tensor (JpegFrame.straight), where torchvision still decodes. None for anything else
    (grey, CMYK, other formats, a header cut short): PIL opens those, as ImageFolder."""
    frame = jpeg_frame(data)
    if frame is None or not frame.straight() or libjpeg_decoder() is None:
        return None
    return frame.height, frame.width


def jpeg_pixels(data: bytes) -> torch.Tensor:
    """uint8 (3, H, W), every pixel of the JPEG DATA: libjpeg-turbo at PIL's settings (the
    same pixels as PIL's), strided channels last as libjpeg writes them. A corrupt or
    truncated file raises OSError, with libjpeg's reason."""
    decoder = libjpeg_decoder()
    assert decoder is not None  # straight_jpeg_size said so
    try:
        return decoder(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    except RuntimeError as error:  # "decode_jpeg, <source>.cpp:171, <libjpeg's reason>"
        raise OSError(str(error).split(".cpp:", 1)[-1].split(", ", 1)[-1]) from None


def resized_uint8(pixels: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 (3, H, W) to (3, SIZE, SIZE), bilinear and antialiased: torchvision's uint8 resize
    (PIL's resampler), given the interleaved layout its vectorised kernel reads."""
    batch = pixels[None].contiguous(memory_format=torch.channels_last)
    return torch.nn.functional.interpolate(
        batch, size=(size, size), mode="bilinear", antialias=True, align_corners=False
    )[0]


DCT_REDUCTIONS = (8, 4, 2)  # the scales 1/8, 1/4, 1/2 that PIL's draft asks libjpeg for


def dct_reduction(height: int, width: int, size: int) -> int:
    """The largest factor (8, 4 or 2; else 1) by which libjpeg may shrink a HEIGHT x WIDTH
    region while decoding and still leave it at least SIZE on each side."""
    return next((factor for factor in DCT_REDUCTIONS if min(height, width) >= size * factor), 1)


def decode_reduced(image: Image, reduction: int) -> int:
    """Let IMAGE, opened and not yet decoded, decode at 1/REDUCTION scale if it is a JPEG; the
    factor it took (1 for other formats)."""
    stored_width, stored_height = image.size
    if reduction > 1:  # PIL picks the largest scale whose size is at least the one asked
        image.draft(None, (stored_width // reduction, stored_height // reduction))
    return max(1, round(stored_width / image.size[0]))


def read_rgb_at_least(source: ImageSource, side: int) -> torch.Tensor:
    """uint8 (3, H, W) with the shorter side at least SIDE where the file allows (a JPEG may
    decode smaller than stored): for views that resize the shorter side to SIDE. A JPEG at
    full scale comes from libjpeg channels last, which torchvision's resize reads fastest."""
    from PIL import Image

    with named_failures(source_name(source)):
        data = encoded(source).data
        stored = straight_jpeg_size(data)
        if stored is not None and dct_reduction(*stored, side) == 1:
            return jpeg_pixels(data)
        with Image.open(io.BytesIO(data)) as image:  # other formats, or a reduced scale
            decode_reduced(image, dct_reduction(image.height, image.width, side))
            return to_tensor(as_rgb(image))


def read_resized_crop(source: ImageSource, box_for: CropBoxFor, size: int) -> torch.Tensor:
    """uint8 (3, SIZE, SIZE), contiguous: the box that BOX_FOR draws from the image's stored
    (height, width), cut and resized (bilinear, antialiased: PIL's uint8 resampler, the one
    torchvision's antialiased resize reproduces) and mirrored if drawn so. The JPEG decodes
    at the smallest scale that leaves the box at least SIZE on each side; at full scale,
    libjpeg-turbo decodes it straight into a tensor, PIL never opening it (the module's
    docstring)."""
    from PIL import Image

    with named_failures(source_name(source)):
        data = encoded(source).data
        stored = straight_jpeg_size(data)
        box = box_for(*stored) if stored else None
        if box and dct_reduction(box.height, box.width, size) == 1:
            interleaved = full_scale_crop(data, box, size)
        else:  # other formats, or a reduced scale: PIL decodes
            with Image.open(io.BytesIO(data)) as image:
                box = box or box_for(image.height, image.width)
                interleaved = pil_crop(image, box, size)
    return planes(interleaved, box.flip)


def full_scale_crop(data: bytes, box: CropBox, size: int) -> np.ndarray:
    """uint8 (SIZE, SIZE, 3): the BOX of the JPEG DATA, decoded whole by libjpeg-turbo and
    resized in uint8 by torch."""
    whole = jpeg_pixels(data)
    crop = whole[:, box.top : box.top + box.height, box.left : box.left + box.width]
    return resized_uint8(crop, size).permute(1, 2, 0).numpy()


def pil_crop(image: Image, box: CropBox, size: int) -> np.ndarray:
    """uint8 (SIZE, SIZE, 3): the BOX (in stored pixels) of IMAGE, opened and not yet decoded,
    decoded by PIL (a JPEG at the reduced scale the box allows), resized with PIL's uint8
    resampler, which takes the box's fractional edges as they are."""
    import numpy as np
    from PIL import Image as PILImage

    reduce = decode_reduced(image, dct_reduction(box.height, box.width, size))
    region = (  # the box in the decoded pixels: a reduced pixel covers REDUCE stored ones
        box.left / reduce,
        box.top / reduce,
        (box.left + box.width) / reduce,
        (box.top + box.height) / reduce,
    )
    return np.asarray(as_rgb(image).resize((size, size), PILImage.Resampling.BILINEAR, box=region))


def planes(interleaved: np.ndarray, flip: bool) -> torch.Tensor:
    """uint8 (3, H, W), contiguous, from (H, W, 3), mirrored if FLIP, in one copy. A loader
    batch stacks contiguous images about 20 times faster than interleaved ones: at 224 px,
    stacking interleaved ones cost more than the resize, this copy a third of that."""
    import numpy as np

    mirrored = interleaved[:, ::-1] if flip else interleaved
    return torch.from_numpy(np.ascontiguousarray(mirrored.transpose(2, 0, 1)))
