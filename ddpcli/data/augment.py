"""Augmentation as a pure function of (seed, epoch, sample index): a sample's crop and flip
never depend on which rank sees it, in which batch, or after a resume. Both data paths
(device-resident batches and the loader) draw from here and give the same pixels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CROP_PADDING = 4


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
