"""--auto-augment: torchvision.transforms.v2's TrivialAugmentWide, RandAugment or
AutoAugment (its ImageNet policy) on each uint8 training image after its crop and flip,
where torchvision's reference presets apply them.

torchvision draws from torch's global generator; here each image's draws happen inside a
forked generator seeded from (seed, epoch, key), a pure function of them: a resume, another
rank or the other data path gives the image the same operations and magnitudes.
"""

from __future__ import annotations

from typing import Any

import torch

from ddpcli.data.augment import STREAM_AUTO_AUGMENT, each_image_seeded, stream_seeds

POLICIES = ("ta_wide", "randaugment", "autoaugment")


def policy_transform(name: str) -> Any:
    """The torchvision transform for --auto-augment NAME; None for `none`."""
    if name == "none":
        return None
    from torchvision.transforms import v2

    if name == "ta_wide":
        return v2.TrivialAugmentWide(interpolation=v2.InterpolationMode.BILINEAR)
    if name == "randaugment":
        return v2.RandAugment(interpolation=v2.InterpolationMode.BILINEAR)
    if name == "autoaugment":
        return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, v2.InterpolationMode.BILINEAR)
    raise ValueError(f"unknown --auto-augment policy {name!r}; use one of {', '.join(POLICIES)}")


def auto_augment_images(
    images: torch.Tensor, keys: torch.Tensor, seed: int, epoch: int, transform: Any
) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> uint8, each image through TRANSFORM with its own draws. One
    image at a time: on a batch torchvision would apply one operation to every image."""
    seeds = stream_seeds(seed, epoch, keys, STREAM_AUTO_AUGMENT)
    return each_image_seeded(images, seeds, transform)
