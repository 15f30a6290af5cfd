"""--random-erase P: torchvision.transforms.v2's RandomErasing on each normalised training
image (value 0, the mean colour, as in torchvision's reference where it follows Normalize).

Each image's draws (whether to erase, the box) are torchvision's, made on the host from a
private generator seeded from (seed, epoch, key): a pure function of them on either data
path, and no other random stream moves. The boxes of a batch then erase it at once on its
device, with one copy queued from the host and no wait for the device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from ddpcli.data.augment import STREAM_ERASE, host_to_device, stream_generators

# RandomErasing's defaults, as torchvision's reference uses them.
ERASE_SCALE = (0.02, 0.33)  # of the image's area
ERASE_RATIO = (0.3, 3.3)  # height / width, drawn log-uniform
ERASE_TRIES = 10
_LOG_RATIO = [float(bound) for bound in torch.log(torch.tensor(ERASE_RATIO))]  # in float32


def erase_box(
    generator: torch.Generator, probability: float, height: int, width: int
) -> tuple[int, int, int, int]:
    """RandomErasing's draws for one HEIGHT x WIDTH image, in its order from GENERATOR:
    (top, left, box height, box width), an empty box where it erases nothing."""
    if torch.rand(1, generator=generator) >= probability:
        return 0, 0, 0, 0
    for _ in range(ERASE_TRIES):
        area = height * width * torch.empty(1).uniform_(*ERASE_SCALE, generator=generator).item()
        aspect = torch.exp(torch.empty(1).uniform_(*_LOG_RATIO, generator=generator)).item()
        box_h = int(round(math.sqrt(area * aspect)))
        box_w = int(round(math.sqrt(area / aspect)))
        if box_h < height and box_w < width:
            top = int(torch.randint(0, height - box_h + 1, size=(1,), generator=generator))
            left = int(torch.randint(0, width - box_w + 1, size=(1,), generator=generator))
            return top, left, box_h, box_w
    return 0, 0, 0, 0  # torchvision gives up after ten tries and leaves the image as it is


def erase_boxes(
    keys: torch.Tensor, seed: int, epoch: int, probability: float, height: int, width: int
) -> torch.Tensor:
    """int64 (N, 4) on the host: each key's box (top, left, height, width)."""
    generators = stream_generators(seed, epoch, keys, STREAM_ERASE)
    boxes = [erase_box(generator, probability, height, width) for generator in generators]
    return torch.tensor(boxes, dtype=torch.int64).view(-1, 4)


def erase_images(
    images: torch.Tensor, keys: torch.Tensor, seed: int, epoch: int, probability: float
) -> torch.Tensor:
    """float (N, 3, H, W), each image erased (or not) by its own draws; a new tensor."""
    height, width = images.shape[-2:]
    boxes = erase_boxes(keys, seed, epoch, probability, height, width)
    top, left, box_h, box_w = host_to_device(boxes, images.device).T.reshape(4, -1, 1, 1, 1)
    rows = torch.arange(height, device=images.device).view(1, 1, height, 1)
    cols = torch.arange(width, device=images.device).view(1, 1, 1, width)
    inside = (rows >= top) & (rows < top + box_h) & (cols >= left) & (cols < left + box_w)
    return images.masked_fill(inside, 0.0)


class ErasedBatches:
    """Training batches with random erasing, each image keyed by its entry in KEYS (the
    epoch's keys for this rank, in batch order; each batch takes as many as it holds)."""

    def __init__(self, batches, keys: list[int], seed: int, epoch: int, p: float):
        self.batches, self.keys = batches, keys
        self.seed, self.epoch, self.probability = seed, epoch, p

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]] = self.batches
        end = 0
        for images, labels in batches:
            start, end = end, end + len(labels)
            keys = torch.tensor(self.keys[start:end])
            erased = erase_images(images, keys, self.seed, self.epoch, self.probability)
            yield erased.contiguous(memory_format=suggested_format(images)), labels


def suggested_format(images: torch.Tensor) -> torch.memory_format:
    if images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format
