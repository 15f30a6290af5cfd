"""Device-resident batches (`--data-path device`): the uint8 set lives in device memory and
each batch is gathered, cropped, flipped and normalised there at once: no DataLoader
workers, no per-image Python on the GPU, no copy of images across PCIe per step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ddpcli.data.augment import (
    CROP_PADDING,
    augmentation_draws,
    box_sampling_maps,
    crop_padded,
    resample_with_maps,
    resized_crop_boxes,
)
from ddpcli.data.autoaugment import auto_augment_images
from ddpcli.data.layout import Augment
from ddpcli.data.loader import Normalise
from ddpcli.data.resharding import split_in_batches
from ddpcli.data.sets import ImageSet


class DeviceResidentBatches:
    """Batches of an in-memory ImageSet, on `device`: gather, augmentation (`rrc`: one
    batched resample of each image's box; `crop-flip`: crop with padding and flip) and
    normalisation done for the whole batch at once. `drop_last` (training) leaves out the
    last, partial batch, as DataLoader's drop_last does; `batch_sizes`, where given, are
    the batches' lengths instead (a re-dealt epoch's rest: ddpcli.data.resharding)."""

    def __init__(
        self,
        images: ImageSet,
        indices: list[int],
        batch_size: int,
        device: torch.device,
        mean: list[float],
        std: list[float],
        augment: Augment,
        seed: int,
        epoch: int,
        channels_last: bool = False,
        drop_last: bool = False,
        image_size: int | None = None,
        auto_augment: Any = None,
        batch_sizes: list[int] | None = None,
    ):
        """`image_size`: the side of the batches, where the set holds its images at another
        (image folders kept whole for `rrc`, --train-crop-size); by default the set's own.
        `indices` are keys (ddpcli.data.ra_sampler): image `key % len(images)`, its draws
        keyed by the key. `auto_augment`: a torchvision policy applied after the crop."""
        self.images = images.images.to(device)  # no copy when the pipeline already moved them
        self.labels = images.labels.to(device)
        self.image_size = image_size or images.images.shape[-1]
        self.batch_size = batch_size
        self.device = device
        self.normalise = Normalise(device, mean, std, channels_last)
        self.augment = augment
        self.seed, self.epoch = seed, epoch
        if batch_sizes is None:
            batch_sizes = split_in_batches(len(indices), batch_size, drop_last)
        self.batch_sizes = batch_sizes
        self.auto_augment = auto_augment
        # Everything a batch needs from the host crosses once per epoch, here. A per-batch
        # copy of pageable memory waits for the whole device stream, so the CPU could never
        # queue the next step while the device runs this one.
        self.cpu_keys = torch.tensor(indices, dtype=torch.long)
        self.indices = self.cpu_keys.to(device)
        self.rows = (self.cpu_keys % len(images)).to(device)
        self.crop_maps = self._crop_maps(images, self.cpu_keys) if augment == "rrc" else None

    def _crop_maps(self, images: ImageSet, keys: torch.Tensor) -> torch.Tensor:
        """Every sample's random-resized-crop box for the epoch, drawn on the CPU from its
        decoded size, as grid_sample maps on the device."""
        stored = torch.tensor(images.images.shape[-2:])
        sizes = stored.expand(len(images), 2) if images.sizes is None else images.sizes.cpu()
        rows = keys % len(images)
        heights, widths = sizes[rows, 0], sizes[rows, 1]
        boxes = resized_crop_boxes(self.seed, self.epoch, keys, heights, widths)
        return box_sampling_maps(boxes, heights, widths).to(self.device)

    def __len__(self) -> int:
        return len(self.batch_sizes)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        end = 0
        for length in self.batch_sizes:
            start, end = end, end + length
            keys = self.indices[start:end]
            batch = self.rows[start:end]
            images = self.images[batch]
            if self.crop_maps is not None:
                maps = self.crop_maps[start:end]
                images = resample_with_maps(images, maps, self.image_size)
            elif self.augment == "crop-flip":
                images = crop_and_flip_batch(images, keys, self.seed, self.epoch)
            if self.auto_augment is not None:  # torchvision's policies take uint8 pixels
                pixels = images.round().clamp_(0, 255).to(torch.uint8)
                cpu_keys = self.cpu_keys[start:end]
                images = auto_augment_images(
                    pixels, cpu_keys, self.seed, self.epoch, self.auto_augment
                )
            yield self.normalise(images, self.labels[batch])


def crop_and_flip_batch(
    images: torch.Tensor, keys: torch.Tensor, seed: int, epoch: int
) -> torch.Tensor:
    """(N, 3, H, W) -> the same shape: each image padded by CROP_PADDING, cropped back at the
    offset drawn for its key and mirrored if drawn so (crop_and_flip_one's draws), at once on
    a device."""
    count, _, height, width = images.shape
    device = images.device
    pad = CROP_PADDING
    top, left, flips = augmentation_draws(seed, epoch, keys)
    padded = F.pad(images, (pad, pad, pad, pad))
    if device.type == "cpu":
        # A slice per sample is much cheaper on the CPU than the 4-D gather; same pixels.
        out = torch.empty_like(images)
        draws = zip(top.tolist(), left.tolist(), flips.tolist(), strict=True)
        for row, (y, x, flip) in enumerate(draws):
            out[row] = crop_padded(padded[row], y, x, flip, height, width)
        return out
    rows = top.view(count, 1) + torch.arange(height, device=device)
    cols = left.view(count, 1) + torch.arange(width, device=device)
    cols = torch.where(flips.view(count, 1), cols.flip(1), cols)
    batch_index = torch.arange(count, device=device).view(count, 1, 1, 1)
    channel_index = torch.arange(3, device=device).view(1, 3, 1, 1)
    return padded[batch_index, channel_index, rows.view(count, 1, height, 1),
                  cols.view(count, 1, 1, width)]  # fmt: skip
