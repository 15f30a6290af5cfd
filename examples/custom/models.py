"""A small residual CNN for `ddpcli train --arch models:small_resnet`."""

import torch
from torch import nn


def conv_bn(channels_in: int, channels_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels_out),
    )


class SmallResNet(nn.Module):
    def __init__(self, num_classes: int, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, width), nn.ReLU(), nn.MaxPool2d(2))
        self.blocks = nn.ModuleList(conv_bn(width, width) for _ in range(depth))
        self.fc = nn.Linear(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = torch.relu(x + block(x))  # a residual connection
        return self.fc(x.mean(dim=(2, 3)))


def small_resnet(num_classes: int, width: int = 32, depth: int = 2) -> nn.Module:
    return SmallResNet(num_classes, width, depth)
