"""--mixup-alpha, --cutmix-alpha: torchvision.transforms.v2's MixUp and CutMix on each
training batch (one of the two per batch when both are on, as torchvision's reference picks
with RandomChoice), making soft targets for the loss.

Each batch's draws are the ones torchvision makes, in its order, from a private generator
seeded from (seed, epoch, batch key): a pure function of them, the same after a resume,
and nothing else's random stream moves (torch.manual_seed would restart every GPU's
generator, dropout's, from the data). The mixing itself is torchvision's arithmetic on the
batch's device.
"""

from __future__ import annotations

import math

import torch

from ddpcli.config.plan import RunPlan
from ddpcli.data.augment import STREAM_MIXING, stream_generators, stream_seeds


class BatchMixing:
    def __init__(self, mixup_alpha: float, cutmix_alpha: float, num_classes: int, seed: int):
        alphas = (("mixup", mixup_alpha), ("cutmix", cutmix_alpha))
        self.choices = [(name, alpha) for name, alpha in alphas if alpha > 0]
        if not self.choices:
            raise ValueError("BatchMixing needs --mixup-alpha or --cutmix-alpha above 0")
        self.num_classes = num_classes
        self.seed = seed

    def draw_seed(self, epoch: int, batch_key: int) -> int:
        return stream_seeds(self.seed, epoch, torch.tensor([batch_key]), STREAM_MIXING)[0]

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, epoch: int, batch_key: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mixed images and their soft targets (float, one row per image, summing to 1)."""
        generator = next(stream_generators(self.seed, epoch, torch.tensor([batch_key]),
                                           STREAM_MIXING))  # fmt: skip
        name, alpha = self.choices[0]
        if len(self.choices) > 1:  # RandomChoice's draw, equal chances
            chances = torch.tensor([1 / len(self.choices)] * len(self.choices))
            name, alpha = self.choices[int(torch.multinomial(chances, 1, generator=generator))]
        share = beta_draw(alpha, generator)
        targets = torch.nn.functional.one_hot(labels, num_classes=self.num_classes).float()
        if name == "mixup":
            return blend_with_previous(images, share), blend_with_previous(targets, share)
        height, width = images.shape[-2:]
        box, kept = cutmix_box(share, height, width, generator)
        top, left, bottom, right = box
        mixed = images.clone()
        mixed[..., top:bottom, left:right] = images.roll(1, 0)[..., top:bottom, left:right]
        return mixed, blend_with_previous(targets, kept)


def beta_draw(alpha: float, generator: torch.Generator) -> float:
    """Beta(alpha, alpha).sample() as torch.distributions draws it: the first share of a
    two-way Dirichlet (MixUp and CutMix keep such a distribution and sample it)."""
    concentration = torch.tensor([[alpha, alpha]])  # float32, as torch.tensor([alpha]) is
    return float(torch._sample_dirichlet(concentration, generator=generator)[0, 0])


def blend_with_previous(values: torch.Tensor, share: float) -> torch.Tensor:
    """torchvision's blend of each row with the one before it (the first with the last):
    SHARE of its own."""
    return values.roll(1, 0).mul_(1.0 - share).add_(values.mul(share))


def cutmix_box(
    share: float, height: int, width: int, generator: torch.Generator
) -> tuple[tuple[int, int, int, int], float]:
    """CutMix's box (top, left, bottom, right) around a random centre, of about 1 - SHARE of
    the area and clipped to the image, and the share of its own pixels each image keeps."""
    centre_x = int(torch.randint(width, size=(1,), generator=generator))
    centre_y = int(torch.randint(height, size=(1,), generator=generator))
    half = 0.5 * math.sqrt(1.0 - share)
    half_w, half_h = int(half * width), int(half * height)
    left, top = max(centre_x - half_w, 0), max(centre_y - half_h, 0)
    right, bottom = min(centre_x + half_w, width), min(centre_y + half_h, height)
    kept = float(1.0 - (right - left) * (bottom - top) / (width * height))
    return (top, left, bottom, right), kept


def build_mixing(cfg: RunPlan, num_classes: int) -> BatchMixing | None:
    if cfg.mixup_alpha <= 0 and cfg.cutmix_alpha <= 0:
        return None
    return BatchMixing(cfg.mixup_alpha, cfg.cutmix_alpha, num_classes, cfg.seed)
