"""--ra-reps N: repeated augmentation (Hoffer et al. 2020; torchvision's reference
`RASampler`, from DeiT). Each epoch every image is repeated N times and the copies go to N
different ranks, each augmenting it its own way; the epoch keeps DistributedSampler's length.

A copy is named by a key, `repetition x size + index`: the data paths load image
`key % size`, and every augmentation draw is keyed by the key, so the N copies of an image
are augmented differently while each draw stays a pure function of (seed, epoch, key).
"""

from __future__ import annotations

import math

import torch


def repeated_shard(
    size: int, world_size: int, rank: int, seed: int, epoch: int, reps: int
) -> list[int]:
    """This rank's keys for the epoch, as torchvision's RASampler orders them (a shuffle,
    each index repeated REPS times in a row, dealt to the ranks in turn), cut to
    DistributedSampler's length, ceil(size / world_size), so an epoch has as many steps."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    order = torch.randperm(size, generator=generator).tolist()
    keys = [copy * size + index for index in order for copy in range(reps)]
    per_rank = math.ceil(size * reps / world_size)
    keys += keys[: per_rank * world_size - len(keys)]  # even out the ranks, as torchvision
    return keys[rank::world_size][: math.ceil(size / world_size)]
