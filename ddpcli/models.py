"""Architecture registry: small built-in nets for CPU work plus torchvision's classifiers."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ddpcli.archs import check_arch


def _conv_bn(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class SmallCNN(nn.Module):
    """Three conv stages and a linear head: learns 32 px images in seconds on a CPU core."""

    def __init__(self, num_classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _conv_bn(3, width),
            nn.MaxPool2d(2),
            _conv_bn(width, 2 * width),
            nn.MaxPool2d(2),
            _conv_bn(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(1),
        )
        self.fc = nn.Linear(4 * width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(images), 1))


class TinyCNN(SmallCNN):
    """The smallest useful net, for tests."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__(num_classes, width=8)


# Keep in step with archs.BUILTIN_ARCHS, which the launcher checks names against.
BUILTIN_MODELS: dict[str, Callable[..., nn.Module]] = {
    "smallcnn": SmallCNN,
    "tinycnn": TinyCNN,
}


def build_model(name: str, num_classes: int) -> nn.Module:
    check_arch(name)
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name](num_classes=num_classes)
    import torchvision

    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
