"""Augmentation as a pure function of (seed, epoch, sample index): a sample's crop and flip
never depend on which rank sees it, in which batch, or after a resume. Both data paths
(device-resident batches and the loader) draw from here.

Two training recipes (`--augment`):
- `crop-flip`: a crop of the image padded by 4 px, and a horizontal flip (small sets);
- `rrc`: torchvision's RandomResizedCrop (area 8-100 %, aspect 3/4-4/3 log-uniform, ten
  tries, then a centre crop) resized to the training size, and a horizontal flip (ImageNet).

A random-resized crop's box is drawn in the pixels of the image as decoded, exactly as
torchvision draws it. The loader cuts it from the decoded image; the device path cuts the
same box, in relative coordinates, from the stored resample of the whole image.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

CROP_PADDING = 4
RRC_SCALE = (0.08, 1.0)  # of the image's area
RRC_RATIO = (3 / 4, 4 / 3)  # width / height, drawn log-uniform
RRC_TRIES = 10


# --- Draws: splitmix64 of (seed, epoch, index) ------------------------------------------

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (
    _signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
)


def _shift_right(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift on int64 (torch's >> is arithmetic)."""
    return (values >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (int64 arithmetic wraps as uint64 would)."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def sample_hash(seed: int, epoch: int, indices: torch.Tensor) -> torch.Tensor:
    """splitmix64 of (seed, epoch, index), computed the same on any device. A sample's crop
    and flip then never depend on which rank sees it, in which batch, or after a resume."""
    base = (seed * 1_000_003 + epoch * 7_919) & _MASK64
    return _mix(indices.to(torch.int64) + _signed(base) + _GOLDEN)


def _rehash(hashes: torch.Tensor, rounds: int) -> torch.Tensor:
    """(N,) hashes -> (N, rounds): round r is splitmix64's (r + 1)-th output from the hash."""
    steps = torch.arange(1, rounds + 1, dtype=torch.int64, device=hashes.device) * _GOLDEN
    return _mix(hashes.view(-1, 1) + steps)


# Independent streams of draws from one (seed, epoch, index): each ingredient its own, so
# switching one on never moves another's draws.
STREAM_AUTO_AUGMENT, STREAM_ERASE, STREAM_MIXING = 101, 102, 103


def stream_seeds(seed: int, epoch: int, indices: torch.Tensor, stream: int) -> list[int]:
    """One non-negative 63-bit seed per index for STREAM: what seeds the private generator
    a key's torchvision-style draws come from, a pure function of (seed, epoch, index)."""
    offset = _signed((stream * 0x9E3779B97F4A7C15) & _MASK64)  # int64 wraps as uint64 would
    hashes = _mix(sample_hash(seed, epoch, indices.cpu()) + offset)
    return (hashes & ((1 << 63) - 1)).tolist()


def stream_generators(
    seed: int, epoch: int, indices: torch.Tensor, stream: int
) -> Iterator[torch.Generator]:
    """A CPU generator per index, seeded from stream_seeds (one object, reseeded: draw from
    each before taking the next). It yields the numbers torch's global generator would after
    torch.manual_seed of the same seed, without touching it: torch.manual_seed reseeds every
    GPU's generator as well, and dropout's stream would restart from the data each batch."""
    generator = torch.Generator()
    for key_seed in stream_seeds(seed, epoch, indices, stream):
        yield generator.manual_seed(key_seed)


def host_to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch's draws, made on the host, on DEVICE without waiting for it: from pinned
    memory a copy is queued behind the step running, where one from pageable memory
    blocks the host until the device has caught up."""
    if device.type == "cpu":
        return values
    if device.type == "cuda":
        values = values.pin_memory()
    return values.to(device, non_blocking=True)


def _unit_pair(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two uniforms in [0, 1) (float64) from each 64-bit word: its high and low 32 bits."""
    scale = 2.0**-32
    return _shift_right(words, 32).double() * scale, (words & 0xFFFFFFFF).double() * scale


def augmentation_draws(seed: int, epoch: int, indices: torch.Tensor):
    """Per sample: crop offsets (rows, cols) in 0..2*padding, and whether to flip."""
    h = sample_hash(seed, epoch, indices)
    span = 2 * CROP_PADDING + 1
    top = _shift_right(h, 40) % span
    left = _shift_right(h, 20) % span
    flip = (h & 1) == 1
    return top, left, flip


# --- crop-flip ----------------------------------------------------------------------------


def crop_and_flip_one(image: torch.Tensor, index: int, seed: int, epoch: int) -> torch.Tensor:
    """The per-image twin of DeviceResidentBatches._crop_and_flip: same draws, same pixels."""
    top, left, flip = augmentation_draws(seed, epoch, torch.tensor([index]))
    pad, height, width = CROP_PADDING, image.shape[1], image.shape[2]
    padded = F.pad(image, (pad, pad, pad, pad))
    return crop_padded(padded, int(top), int(left), bool(flip), height, width)


def crop_padded(
    padded: torch.Tensor, top: int, left: int, flip: bool, height: int, width: int
) -> torch.Tensor:
    """One (3, height, width) crop of a padded image at (top, left), mirrored if `flip`."""
    crop = padded[:, top : top + height, left : left + width]
    return crop.flip(2) if flip else crop


# --- rrc: the random-resized crop ---------------------------------------------------------


@dataclass
class CropBoxes:
    """Per sample, in the pixels of the image as decoded: int64 (N,) top, left, height, width
    of the box, and bool (N,) whether to mirror it."""

    top: torch.Tensor
    left: torch.Tensor
    height: torch.Tensor
    width: torch.Tensor
    flip: torch.Tensor


_EXP_SERIES = [1 / math.factorial(k) for k in range(13)]


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp by its Taylor series (|x| < 0.3 here: 13 terms reach float64's precision), from
    products and sums alone, which every device and vector width rounds alike. torch.exp
    may differ by an ulp between a batch and a single image, and so move a box's edge."""
    result = torch.full_like(x, _EXP_SERIES[-1])
    for coefficient in reversed(_EXP_SERIES[:-1]):
        result = result * x + coefficient
    return result


def resized_crop_boxes(
    seed: int, epoch: int, indices: torch.Tensor, heights: torch.Tensor, widths: torch.Tensor
) -> CropBoxes:
    """torchvision's RandomResizedCrop.get_params for each sample, all tries at once, drawn
    from the sample's hash instead of the global RNG. `heights`, `widths`: (N,) sizes of the
    images as decoded. Computed on the CPU in float64, so every path gets the same box."""
    hashes = sample_hash(seed, epoch, indices.cpu())
    words = _rehash(hashes, 2 * RRC_TRIES)  # per try: one word for the shape, one to place it
    area_u, aspect_u = _unit_pair(words[:, 0::2])
    top_u, left_u = _unit_pair(words[:, 1::2])
    image_h = heights.cpu().double().view(-1, 1)
    image_w = widths.cpu().double().view(-1, 1)
    area = image_h * image_w * (RRC_SCALE[0] + (RRC_SCALE[1] - RRC_SCALE[0]) * area_u)
    log_low, log_high = math.log(RRC_RATIO[0]), math.log(RRC_RATIO[1])
    aspect = _exp(log_low + (log_high - log_low) * aspect_u)
    box_w = torch.round(torch.sqrt(area * aspect))  # round half to even, as Python's round
    box_h = torch.round(torch.sqrt(area / aspect))
    fits = (box_w > 0) & (box_w <= image_w) & (box_h > 0) & (box_h <= image_h)
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)  # the first try that fits

    def chosen(values: torch.Tensor) -> torch.Tensor:
        return values.gather(1, first).squeeze(1)

    box_h, box_w = chosen(box_h), chosen(box_w)
    image_h, image_w = image_h.squeeze(1), image_w.squeeze(1)
    top = torch.floor(chosen(top_u) * (image_h - box_h + 1))  # randint(0, H - h + 1)
    left = torch.floor(chosen(left_u) * (image_w - box_w + 1))
    centre = _centre_boxes(image_h, image_w)
    found = fits.any(dim=1)
    top, left, box_h, box_w = (
        torch.where(found, drawn, fallback).to(torch.int64)
        for drawn, fallback in zip((top, left, box_h, box_w), centre, strict=True)
    )
    return CropBoxes(top, left, box_h, box_w, flip=(hashes & 1) == 1)


def _centre_boxes(image_h: torch.Tensor, image_w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """torchvision's fallback after ten failed tries: the centred box of the nearest allowed
    aspect (the whole image if its own aspect is allowed). Returns top, left, height, width."""
    low, high = RRC_RATIO
    aspect = image_w / image_h
    tall, wide = aspect < low, aspect > high
    box_w = torch.where(wide, torch.round(image_h * high), image_w)
    box_h = torch.where(tall, torch.round(image_w / low), image_h)
    return (
        torch.div(image_h - box_h, 2, rounding_mode="floor"),
        torch.div(image_w - box_w, 2, rounding_mode="floor"),
        box_h,
        box_w,
    )


class CropBox(NamedTuple):
    """One image's random-resized crop, in the pixels of the image as stored."""

    top: int
    left: int
    height: int
    width: int
    flip: bool


def crop_box_one(index: int, seed: int, epoch: int, height: int, width: int) -> CropBox:
    """The box resized_crop_boxes draws for one image of HEIGHT x WIDTH, in Python's own
    integers and float64: the same operations in the same order (IEEE rounds each alike),
    without a hundred small tensor operations per image in a loader worker.
    tests/test_augment.py checks it against the batched draw."""
    hashed = _mix_int(((seed * 1_000_003 + epoch * 7_919) + index + _GOLDEN) & _MASK64)
    image_h, image_w = float(height), float(width)
    log_low, log_high = math.log(RRC_RATIO[0]), math.log(RRC_RATIO[1])
    for attempt in range(RRC_TRIES):
        shape_word = _mix_int((hashed + (2 * attempt + 1) * _GOLDEN) & _MASK64)
        place_word = _mix_int((hashed + (2 * attempt + 2) * _GOLDEN) & _MASK64)
        area_u, aspect_u = (shape_word >> 32) * 2.0**-32, (shape_word & 0xFFFFFFFF) * 2.0**-32
        area = image_h * image_w * (RRC_SCALE[0] + (RRC_SCALE[1] - RRC_SCALE[0]) * area_u)
        aspect = _exp_float(log_low + (log_high - log_low) * aspect_u)
        box_w, box_h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < box_w <= width and 0 < box_h <= height:
            top_u, left_u = (place_word >> 32) * 2.0**-32, (place_word & 0xFFFFFFFF) * 2.0**-32
            top = math.floor(top_u * (image_h - box_h + 1))
            left = math.floor(left_u * (image_w - box_w + 1))
            return CropBox(top, left, box_h, box_w, bool(hashed & 1))
    low, high = RRC_RATIO
    box_w = round(image_h * high) if image_w / image_h > high else width
    box_h = round(image_w / low) if image_w / image_h < low else height
    top, left = math.floor((height - box_h) / 2), math.floor((width - box_w) / 2)
    return CropBox(top, left, box_h, box_w, bool(hashed & 1))


def _mix_int(z: int) -> int:
    """splitmix64's finaliser on a Python int in [0, 2**64): _mix's bits, one sample."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _exp_float(x: float) -> float:
    """_exp on one float: the same series, the same order."""
    result = _EXP_SERIES[-1]
    for coefficient in reversed(_EXP_SERIES[:-1]):
        result = result * x + coefficient
    return result


def resized_crop_one(
    image: torch.Tensor, index: int, seed: int, epoch: int, size: int
) -> torch.Tensor:
    """The random-resized crop of one uint8 image held in memory: the box cut from it,
    resized (bilinear, antialiased) to size x size, mirrored if drawn so. (Image files take
    ddpcli.data.decode.read_resized_crop, which decodes only what the crop needs.)"""
    from torchvision.transforms.v2 import functional as TF

    box = crop_box_one(index, seed, epoch, *image.shape[-2:])
    # Contiguous first: resize's uint8 kernel needs it, and a strided crop takes a float
    # detour several times slower. Same pixels as TF.resized_crop.
    crop = image[:, box.top : box.top + box.height, box.left : box.left + box.width].contiguous()
    crop = TF.resize(crop, [size, size], antialias=True)
    return crop.flip(2) if box.flip else crop


def resample_boxes(
    images: torch.Tensor, boxes: CropBoxes, heights: torch.Tensor, widths: torch.Tensor, size: int
) -> torch.Tensor:
    """The device path's random-resized crop of a batch, in one bilinear grid_sample: `images`
    (N, 3, S, S) hold each whole image resampled to a square; the boxes, drawn in the decoded
    (heights, widths) pixels, are mapped to relative coordinates, so the crop covers the same
    region as the loader's. Returns float (N, 3, size, size) on the 0-255 scale."""
    maps = box_sampling_maps(boxes, heights, widths).to(images.device)
    return resample_with_maps(images, maps, size)


def box_sampling_maps(
    boxes: CropBoxes, heights: torch.Tensor, widths: torch.Tensor
) -> torch.Tensor:
    """(N, 4) float32 on the CPU: each box as grid_sample's [x slope, x offset, y slope,
    y offset]. Drawn once per epoch, so that the batches need no copy from the host."""
    image_h, image_w = heights.cpu().double(), widths.cpu().double()
    top, bottom = boxes.top / image_h, (boxes.top + boxes.height) / image_h
    left, right = boxes.left / image_w, (boxes.left + boxes.width) / image_w
    mirror = torch.where(boxes.flip, -1.0, 1.0).double()
    # grid_sample's coordinates run over [-1, 1] edge to edge (align_corners=False): output
    # pixel centre u maps to (right - left) * u + (left + right - 1) in the input; a mirror
    # negates the slope.
    return torch.stack([(right - left) * mirror, left + right - 1, bottom - top,
                        top + bottom - 1], dim=1).float()  # fmt: skip


def resample_with_maps(images: torch.Tensor, maps: torch.Tensor, size: int) -> torch.Tensor:
    """grid_sample of each image by its row of `maps` (on the images' device). The map is
    separable, so the grid is two outer sums, where affine_grid's batched matrix product
    takes many times longer on the CPU."""
    x_slope, x_offset, y_slope, y_offset = maps.T
    centres = (torch.arange(size, device=images.device, dtype=torch.float32) * 2 + 1) / size - 1
    cols = x_slope.view(-1, 1, 1) * centres.view(1, 1, size) + x_offset.view(-1, 1, 1)
    rows = y_slope.view(-1, 1, 1) * centres.view(1, size, 1) + y_offset.view(-1, 1, 1)
    grid = torch.stack(torch.broadcast_tensors(cols, rows), dim=-1)  # (N, size, size, [x, y])
    return F.grid_sample(
        images.float(), grid, mode="bilinear", padding_mode="border", align_corners=False
    )
