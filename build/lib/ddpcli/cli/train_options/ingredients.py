"""`ddpcli train`'s Recipe ingredients panel: the parts of torchvision's modern training
recipe, each off (or neutral) by default."""

from __future__ import annotations

from typing import Annotated

from ddpcli.cli.train_options import train_option

PANEL = "Recipe ingredients (docs/train.md)"

SyncBn = Annotated[bool | None, train_option("sync_bn", panel=PANEL)]

Ema = Annotated[bool | None, train_option("ema", panel=PANEL)]

EmaDecay = Annotated[
    float | None,
    train_option(
        "ema_decay",
        "EMA decay, adjusted as torchvision's reference does: 1 - (1 - F) x global batch x "
        "--ema-steps / --epochs.",
        PANEL,
    ),
]

EmaSteps = Annotated[int | None, train_option("ema_steps", panel=PANEL)]

MixupAlpha = Annotated[float | None, train_option("mixup_alpha", panel=PANEL)]

CutmixAlpha = Annotated[
    float | None,
    train_option(
        "cutmix_alpha",
        "CutMix's Beta(alpha, alpha); 0: off. With --mixup-alpha too, one of the two per "
        "batch; the loss takes the mixed (soft) targets.",
        PANEL,
    ),
]

AutoAugment = Annotated[str | None, train_option("auto_augment", panel=PANEL)]

RandomErase = Annotated[float | None, train_option("random_erase", panel=PANEL)]

RaReps = Annotated[int | None, train_option("ra_reps", panel=PANEL)]

TrainCropSize = Annotated[
    int | None,
    train_option(
        "train_crop_size",
        "Side of the random-resized crop that training sees (--augment rrc).",
        PANEL,
        default="--image-size",
    ),
]

ValResizeSize = Annotated[
    int | None,
    train_option(
        "val_resize_size",
        "Validation: shorter side resized to N, then the centre crop.",
        PANEL,
        default="--val-crop-size / 0.875 for image folders; the crop for synthetic/stl10",
    ),
]

ValCropSize = Annotated[
    int | None,
    train_option("val_crop_size", "Validation's centre crop.", PANEL, default="--image-size"),
]

NormWeightDecay = Annotated[float | None, train_option("norm_weight_decay", panel=PANEL)]
