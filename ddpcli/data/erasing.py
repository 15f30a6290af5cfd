"""--random-erase P: torchvision.transforms.v2's RandomErasing on each normalised training
image (value 0, the mean colour, as in torchvision's reference where it follows Normalize).

Each image's draws (whether to erase, the box) come from a forked generator seeded from
(seed, epoch, key), so they are a pure function of them on either data path.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ddpcli.data.augment import STREAM_ERASE, each_image_seeded, stream_seeds


def erase_images(
    images: torch.Tensor, keys: torch.Tensor, seed: int, epoch: int, probability: float
) -> torch.Tensor:
    """float (N, 3, H, W), each image erased (or not) by its own draws; a new tensor."""
    from torchvision.transforms import v2

    eraser = v2.RandomErasing(p=probability, value=0)
    return each_image_seeded(images, stream_seeds(seed, epoch, keys, STREAM_ERASE), eraser)


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
