"""--mixup-alpha, --cutmix-alpha: torchvision.transforms.v2's MixUp and CutMix on each
training batch (one of the two per batch when both are on, as torchvision's reference picks
with RandomChoice), making soft targets for the loss.

torchvision draws from torch's global generator; here each batch's draws happen inside a
forked generator seeded from (seed, epoch, batch key), so they are a pure function of them:
the same after a resume, and nothing else's random stream moves.
"""

from __future__ import annotations

import torch

from ddpcli.config import TrainConfig
from ddpcli.data.augment import STREAM_MIXING, stream_seeds


class BatchMixing:
    def __init__(self, mixup_alpha: float, cutmix_alpha: float, num_classes: int, seed: int):
        from torchvision.transforms import v2

        choices: list[v2.Transform] = []
        if mixup_alpha > 0:
            choices.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
        if cutmix_alpha > 0:
            choices.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
        if not choices:
            raise ValueError("BatchMixing needs --mixup-alpha or --cutmix-alpha above 0")
        self.transform = choices[0] if len(choices) == 1 else v2.RandomChoice(choices)
        self.seed = seed

    def draw_seed(self, epoch: int, batch_key: int) -> int:
        return stream_seeds(self.seed, epoch, torch.tensor([batch_key]), STREAM_MIXING)[0]

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, epoch: int, batch_key: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixed images and their soft targets (float, one row per image, summing to 1)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.draw_seed(epoch, batch_key))
            return self.transform(images, labels)


def build_mixing(cfg: TrainConfig, num_classes: int) -> BatchMixing | None:
    if cfg.mixup_alpha <= 0 and cfg.cutmix_alpha <= 0:
        return None
    return BatchMixing(cfg.mixup_alpha, cfg.cutmix_alpha, num_classes, cfg.seed)
