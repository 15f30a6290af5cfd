"""`--decode gpu`: JPEGs decoded where the model trains.

On the CPU path a loader worker decodes each JPEG, crops and resizes it; at 224 px the
host's cores run out before an H100 does (docs/performance.md, "GPU figures"). Here the
work is split in two halves:
- the workers' half (`EncodedFiles`, `EncodedMembers`): read each file's bytes, its stored
  size from the JPEG's frame header, and draw its crop box from that size with the CPU
  path's own draw (`crop_box_one`: a seed gives the same boxes on both paths). An image
  the device's decoder does not take in its batches (PNG, CMYK, grey, 12-bit, and
  progressive JPEGs, which torchvision's nvjpeg call decodes one at a time with a Huffman
  pass on the rank's own thread) is decoded by the worker with PIL instead, as the CPU path
  would, and travels as pixels.
  A batch of either travels as one byte buffer (`EncodedBatch`): one shared-memory block
  per batch, not one per image.
- the rank's half (`DecodeOnDevice`): the batch's JPEGs decoded at once on its device
  (nvjpeg on a GPU, `torchvision`'s batched decoder; libjpeg-turbo on the CPU, the same
  call, so CI runs this code), then the training view on the device: the box cut and
  resized (bilinear, antialiased, rounded to whole levels as the CPU path's uint8 resize
  is), mirrored, the padded crop and flip or the auto-augment policy where asked, and
  normalised, channels last on GPUs. Validation's centred view the same way.
Images decoded on the CPU instead (by the worker, or by the rank where nvjpeg refused a
file at run time) are counted: each epoch's row of metrics.jsonl says how many.

Against the CPU path, for the same seed: the same boxes and flips; pixels within one level
where the CPU path decodes at full scale (its uint8 resize against this float one), within
interpolation tolerance where it decodes a large JPEG at a reduced scale
(tests/test_decode_on_device.py measures both).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import torch

from ddpcli.data.augment import crop_box_one
from ddpcli.data.autoaugment import auto_augment_images
from ddpcli.data.decode import (
    EncodedImage,
    ImageSource,
    encoded,
    jpeg_frame,
    jpeg_pixels,
    libjpeg_decoder,
    named_failures,
    read_rgb,
)
from ddpcli.data.device import crop_and_flip_batch
from ddpcli.data.layout import Augment, Sample, resize_side
from ddpcli.data.loader import Normalise

# torchvision's ImageReadMode.RGB: colour out, whatever the JPEG holds.
RGB_MODE = 3


@functools.cache
def nvjpeg_decoder() -> Any:
    """torchvision's batched nvjpeg op, or None where this torchvision has none (a build
    without CUDA, or its decoders gone: deprecated from 0.29). The op itself, not
    `torchvision.io.decode_jpeg`, which warns and logs on every call."""
    try:
        import torchvision.io  # noqa: F401  # registers the image ops

        return torch.ops.image.decode_jpegs_cuda
    except (ImportError, AttributeError, RuntimeError):
        return None


def device_decoder_missing(device_type: str) -> str | None:
    """Why a rank on DEVICE_TYPE cannot decode JPEGs itself, or None where it can."""
    if device_type == "cuda":
        return None if nvjpeg_decoder() is not None else "this torchvision has no nvjpeg op"
    if libjpeg_decoder() is None:
        return "this torchvision has no JPEG decoder op"
    return None


class EncodedItem(NamedTuple):
    """One image as a worker hands it over: the JPEG's bytes (RAW False) or the pixels a
    worker decoded, uint8 (3, HEIGHT, WIDTH) flattened (RAW True); the crop box drawn from
    its stored size (top, left, height, width, flip; zeros for a centred view)."""

    data: torch.Tensor
    height: int
    width: int
    raw: bool
    box: tuple[int, int, int, int, int]
    name: str


NO_BOX = (0, 0, 0, 0, 0)


def encoded_item(source: ImageSource, box_for: Any = None) -> EncodedItem:
    """SOURCE as the workers' half hands it over (the module's docstring); BOX_FOR: the crop
    box drawn from the stored (height, width), None for a centred view. A file that cannot
    be read fails here, naming it, as on the CPU path."""
    image = encoded(source)
    frame = jpeg_frame(image.data)
    if frame is not None and frame.straight() and frame.baseline:
        data = torch.frombuffer(bytearray(image.data), dtype=torch.uint8)
        height, width, raw = frame.height, frame.width, False
    else:  # PIL decodes it here, as ImageFolder would (named_failures inside)
        pixels = read_rgb(image)
        data, (height, width), raw = pixels.reshape(-1), pixels.shape[-2:], True
    box = tuple(int(value) for value in box_for(height, width)) if box_for else NO_BOX
    return EncodedItem(data, height, width, raw, box, image.name)  # type: ignore[arg-type]


@dataclasses.dataclass
class EncodedBatch:
    """A batch of EncodedItems in one buffer: DATA holds every item's bytes back to back,
    ENDS where each ends. SIZES (N, 2) the stored sizes, BOXES (N, 5), RAW (N,) which items
    are pixels; KEYS the samples' keys (their augmentation draws), EPOCH theirs."""

    data: torch.Tensor
    ends: torch.Tensor
    sizes: torch.Tensor
    boxes: torch.Tensor
    raw: torch.Tensor
    keys: torch.Tensor
    epoch: int
    names: list[str]

    @classmethod
    def of(cls, items: list[EncodedItem], keys: list[int], epoch: int) -> EncodedBatch:
        lengths = torch.tensor([len(item.data) for item in items], dtype=torch.int64)
        return cls(
            data=torch.cat([item.data for item in items]),
            ends=lengths.cumsum(0),
            sizes=torch.tensor([(item.height, item.width) for item in items], dtype=torch.int64),
            boxes=torch.tensor([item.box for item in items], dtype=torch.int64),
            raw=torch.tensor([item.raw for item in items], dtype=torch.bool),
            keys=torch.tensor(keys, dtype=torch.int64),
            epoch=epoch,
            names=[item.name for item in items],
        )

    def __len__(self) -> int:
        return len(self.ends)

    def starts(self) -> torch.Tensor:
        return self.ends - torch.diff(self.ends, prepend=self.ends.new_zeros(1))

    def __getitem__(self, span: slice) -> EncodedBatch:
        """Items START:STOP, not empty (a shards chunk split between two batches)."""
        start, stop, _ = span.indices(len(self))
        begin, end = int(self.starts()[start]), int(self.ends[stop - 1])
        return EncodedBatch(
            self.data[begin:end], self.ends[span] - begin, self.sizes[span], self.boxes[span],
            self.raw[span], self.keys[span], self.epoch, self.names[span],
        )  # fmt: skip

    @classmethod
    def cat(cls, parts: list[EncodedBatch]) -> EncodedBatch:
        offsets = torch.tensor([0] + [len(part.data) for part in parts[:-1]]).cumsum(0)
        return cls(
            torch.cat([part.data for part in parts]),
            torch.cat(
                [part.ends + int(offset) for part, offset in zip(parts, offsets, strict=True)]
            ),
            torch.cat([part.sizes for part in parts]),
            torch.cat([part.boxes for part in parts]),
            torch.cat([part.raw for part in parts]),
            torch.cat([part.keys for part in parts]),
            parts[0].epoch,
            [name for part in parts for name in part.names],
        )

    def items(self) -> list[torch.Tensor]:
        """Each item's bytes, as views into DATA."""
        starts, ends = self.starts().tolist(), self.ends.tolist()
        return [self.data[start:end] for start, end in zip(starts, ends, strict=True)]

    def pin_memory(self) -> EncodedBatch:
        """The DataLoader's pinning thread asks: the decoder reads the bytes from pageable
        host memory itself, and a raw item's pixels are a rare few."""
        return self


def joined(parts: list[Any]) -> Any:
    """The parts of one batch (shards' chunks) as one: pixels or encoded."""
    if isinstance(parts[0], EncodedBatch):
        return EncodedBatch.cat(parts)
    return torch.cat(parts)


def collate_encoded(
    items: list[tuple[EncodedItem, int, int, int]],
) -> tuple[EncodedBatch, torch.Tensor]:
    """The loader's collate for EncodedFiles' items (item, label, key, epoch)."""
    batch = EncodedBatch.of(
        [item for item, _, _, _ in items], [key for _, _, key, _ in items], items[0][3]
    )
    return batch, torch.tensor([label for _, label, _, _ in items], dtype=torch.int64)


class EncodedFiles(torch.utils.data.Dataset):
    """The workers' half over an image folder: FolderDataset's twin for `--decode gpu`.
    Items are keyed by (sample key, epoch), as KeyedImages' are."""

    def __init__(self, samples: list[Sample], seed: int, augment: Augment) -> None:
        self.samples, self.seed, self.augment = samples, seed, augment

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: tuple[int, int]) -> tuple[EncodedItem, int, int, int]:
        sample_key, epoch = key
        path, label = self.samples[sample_key % len(self)]
        return (
            encoded_item(path, box_drawer(self.augment, sample_key, self.seed, epoch)),
            label,
            *key,
        )


class EncodedMembers:
    """The workers' half over shard members (ddpcli.data.shards.feed), keyed by the
    sample's number in the index."""

    def __init__(self, seed: int, augment: Augment) -> None:
        self.seed, self.augment = seed, augment

    def image(self, sample: Any, epoch: int) -> EncodedItem:  # a RawSample
        draw = box_drawer(self.augment, sample.number, self.seed, epoch)
        return encoded_item(EncodedImage(sample.name, sample.image), draw)


def box_drawer(augment: Augment, key: int, seed: int, epoch: int) -> Any:
    """The random-resized crop's draw for KEY (stored height, width -> CropBox), or None
    where the view is centred."""
    return functools.partial(crop_box_one, key, seed, epoch) if augment == "rrc" else None


class DecodeOnDevice:
    """The rank's half (the module's docstring): EncodedBatch -> the normalised batch on
    DEVICE. AUGMENT `rrc` cuts each item's box and resizes it to SIZE; otherwise the centred
    view VIEW (resize the shorter side, crop the centre), then the padded crop and flip for
    `crop-flip`. DECODED_ON_CPU counts the images decoded on the CPU instead."""

    def __init__(
        self,
        device: torch.device,
        mean: list[float],
        std: list[float],
        channels_last: bool,
        augment: Augment,
        size: int,
        seed: int,
        view: tuple[int, int] | None = None,
        auto_augment: Any = None,
    ) -> None:
        self.device, self.augment, self.size, self.seed = device, augment, size, seed
        self.view = view or (resize_side(size), size)
        self.auto_augment = auto_augment
        self.normalise = Normalise(device, mean, std, channels_last)
        self.decoded_on_cpu = 0

    def __call__(
        self, batch: EncodedBatch, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = self.decoded(batch)
        images = torch.stack(
            [self.viewed(image, box) for image, box in zip(pixels, batch.boxes, strict=True)]
        )
        images = images.round_()  # whole levels, as the CPU path's uint8 resize gives
        if self.augment == "rrc":
            flips = batch.boxes[:, 4].to(torch.bool).to(self.device, non_blocking=True)
            images = torch.where(flips.view(-1, 1, 1, 1), images.flip(-1), images)
        elif self.augment == "crop-flip":
            keys = batch.keys.to(self.device, non_blocking=True)
            images = crop_and_flip_batch(images, keys, self.seed, batch.epoch)
        if self.auto_augment is not None:  # torchvision's policies take uint8 pixels
            pixels_u8 = images.clamp_(0, 255).to(torch.uint8)
            images = auto_augment_images(
                pixels_u8, batch.keys, self.seed, batch.epoch, self.auto_augment
            ).float()
        return self.normalise(images, labels)

    # --- decoding
    def decoded(self, batch: EncodedBatch) -> list[torch.Tensor]:
        """uint8 (3, H, W) per item, on the device: the JPEGs decoded together, the raw
        items' pixels moved."""
        items, raw = batch.items(), batch.raw.tolist()
        heights, widths = batch.sizes[:, 0].tolist(), batch.sizes[:, 1].tolist()
        out: list[torch.Tensor | None] = [None] * len(items)
        jpegs = [row for row, is_raw in enumerate(raw) if not is_raw]
        decoded = self.decode_jpegs(
            [items[row] for row in jpegs], [batch.names[row] for row in jpegs]
        )
        for row, image in zip(jpegs, decoded, strict=True):
            out[row] = image
        for row in (row for row, is_raw in enumerate(raw) if is_raw):
            shape = (3, heights[row], widths[row])
            out[row] = items[row].view(shape).to(self.device, non_blocking=True)
            self.decoded_on_cpu += 1
        return out  # type: ignore[return-value]  # every row filled

    def decode_jpegs(self, jpegs: list[torch.Tensor], names: list[str]) -> list[torch.Tensor]:
        """The JPEGS (bytes), decoded on the device; NAMES name them in an error."""
        if not jpegs:
            return []
        if self.device.type != "cuda":
            return [on_cpu(data, name) for data, name in zip(jpegs, names, strict=True)]
        try:
            return nvjpeg_decoder()(jpegs, RGB_MODE, self.device)
        except RuntimeError:  # one file nvjpeg refuses fails the batch: each on its own
            return [self.one_on_gpu(data, name) for data, name in zip(jpegs, names, strict=True)]

    def one_on_gpu(self, data: torch.Tensor, name: str) -> torch.Tensor:
        try:
            return nvjpeg_decoder()([data], RGB_MODE, self.device)[0]
        except RuntimeError:  # e.g. a chroma subsampling nvjpeg does not know
            self.decoded_on_cpu += 1
            return on_cpu(data, name).to(self.device)

    # --- the view
    def viewed(self, image: torch.Tensor, box: torch.Tensor) -> torch.Tensor:
        """float (3, SIZE, SIZE), 0..255: the item's box or its centred view."""
        from torchvision.transforms.v2 import functional as TF

        if self.augment == "rrc":
            top, left, height, width, _ = box.tolist()
            crop = image[None, :, top : top + height, left : left + width].float()
            return torch.nn.functional.interpolate(
                crop, size=(self.size, self.size), mode="bilinear", antialias=True,
                align_corners=False,
            )[0]  # fmt: skip
        resize, crop_side = self.view
        resized = TF.resize(image.float(), resize, antialias=True)
        return TF.center_crop(resized, [crop_side, crop_side])

    def describe(self) -> str:
        where = "nvjpeg" if self.device.type == "cuda" else "libjpeg-turbo"
        return f"{where} on {self.device}"


def on_cpu(data: torch.Tensor, name: str) -> torch.Tensor:
    """The JPEG DATA decoded by libjpeg-turbo on the CPU (PIL's pixels); a corrupt file
    fails naming it, NAME."""
    with named_failures(name):
        return jpeg_pixels(bytes(data.numpy()))
