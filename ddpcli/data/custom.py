"""`--dataset pkg.module:factory`: the user's own data sets on the loader path.

The factory is called as `factory(data_dir=..., image_size=...)` and returns `(train, val,
class_names)`: two map-style data sets whose items are `(image, label)`, each image a PIL
image or a CHW tensor (uint8, or float in [0, 1]), and the class names in label order.
From there they are served as image folders are: the same DistributedSampler shards,
strided unpadded validation, augmentation drawn from (seed, epoch, index), ImageNet
normalisation, so exact validation and exact resume hold for them too. The data sets
should therefore not augment themselves: `--augment` does it, reproducibly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ddpcli.config import TrainConfig
from ddpcli.data.decode import as_rgb, to_tensor
from ddpcli.data.layout import Augment
from ddpcli.data.loader import KeyedImages
from ddpcli.data.sets import centre_view
from ddpcli.errors import USAGE, DdpcliError, first_line, usage_error
from ddpcli.factories import call_factory, load_factory

FLAG = "--dataset"
SHAPE = "(train, val, class_names)"


@dataclass
class CustomSplits:
    """The user's train and validation sets, as their factory returned them."""

    train: Any
    val: Any
    num_classes: int
    class_names: list[str]
    skipped: list[str] = field(default_factory=list)  # never any: the user's sets decode


class BadItem(DdpcliError):
    """An item of the user's data set that is not `(image, label)` as documented: exit 2.

    Raised in a DataLoader worker, it reaches the training process re-created from the
    worker's formatted traceback; only its last line, the message, is kept."""

    def __init__(self, message: str) -> None:
        last = (message.strip().splitlines() or [message])[-1]
        super().__init__(last.split(f"{BadItem.__name__}: ", 1)[-1], USAGE)


def custom_splits(cfg: TrainConfig) -> CustomSplits:
    """Call the factory and check what it returned, down to each split's first item."""
    factory = load_factory(cfg.dataset, FLAG)
    returned = call_factory(
        factory, cfg.dataset, FLAG, data_dir=cfg.data_dir, image_size=cfg.image_size
    )
    if not isinstance(returned, (tuple, list)) or len(returned) != 3:
        raise usage_error(
            f"invalid {FLAG}: {cfg.dataset} must return {SHAPE}; it returned {describe(returned)}"
        )
    train, val, class_names = returned
    names = check_class_names(class_names, cfg.dataset)
    for split, dataset in (("train", train), ("val", val)):
        check_split(dataset, split, cfg.dataset)
        image, label = item_of(dataset, 0, split, cfg.dataset)
        as_uint8_image(image, f"{cfg.dataset} {split} item 0")
        checked_label(label, len(names), f"{cfg.dataset} {split} item 0")
    return CustomSplits(train, val, len(names), names)


def describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a value of type {type(value).__name__}"


def check_class_names(class_names: Any, spec: str) -> list[str]:
    if not isinstance(class_names, Sequence) or isinstance(class_names, str):
        raise usage_error(
            f"invalid {FLAG}: {spec}'s class_names (the third of {SHAPE}) must be a list of "
            f"names in label order; it is {describe(class_names)}"
        )
    if len(class_names) < 2:
        raise usage_error(
            f"invalid {FLAG}: {spec} names {len(class_names)} class(es); a classifier needs 2 "
            "or more"
        )
    return [str(name) for name in class_names]


def check_split(dataset: Any, split: str, spec: str) -> None:
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise usage_error(
            f"invalid {FLAG}: {spec}'s {split} set must be a map-style data set (with __len__ "
            f"and __getitem__, e.g. a torch Dataset); it is {describe(dataset)}"
        )
    if len(dataset) == 0:
        raise usage_error(f"invalid {FLAG}: {spec}'s {split} set is empty")


def item_of(dataset: Any, index: int, split: str, spec: str) -> tuple[Any, Any]:
    """`dataset[index]` as (image, label); whatever goes wrong names the item."""
    where = f"{spec} {split} item {index}"
    try:
        item = dataset[index]
    except Exception as error:
        raise BadItem(
            f"invalid {FLAG}: reading {where} raised {type(error).__name__}: {first_line(error)}"
        ) from None
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise BadItem(f"invalid {FLAG}: {where} must be (image, label); it is {describe(item)}")
    return item[0], item[1]


def as_uint8_image(image: Any, where: str) -> torch.Tensor:
    """uint8 (3, H, W), whatever form of image the data set gives."""
    from PIL import Image

    if isinstance(image, Image.Image):
        try:
            return to_tensor(as_rgb(image))  # as an image file's pixels: 16-bit grey scaled
        except ValueError as error:
            raise BadItem(f"invalid {FLAG}: {where}'s image: {first_line(error)}") from None
    if isinstance(image, torch.Tensor) and image.ndim == 3 and image.shape[0] in (1, 3):
        if image.dtype.is_floating_point:
            image = float_as_uint8(image, where)
        if image.dtype == torch.uint8:
            return image.expand(3, -1, -1) if image.shape[0] == 1 else image
    shown = (
        f"a {image.dtype} tensor of shape {tuple(image.shape)}"
        if isinstance(image, torch.Tensor)
        else f"a value of type {type(image).__name__}"
    )
    raise BadItem(
        f"invalid {FLAG}: {where}'s image must be a PIL image or a (3, H, W) tensor, uint8 or "
        f"float in [0, 1]; it is {shown}"
    )


# A float image's values may pass [0, 1] by this much: resampling (bicubic, antialiased)
# overshoots at sharp edges. Images in 0..255, or normalised, go far beyond it.
FLOAT_OVERSHOOT = 0.1


def float_as_uint8(image: torch.Tensor, where: str) -> torch.Tensor:
    """Floats in [0, 1], as ToTensor makes them, to uint8. Any other range (0..255, or
    already normalised) is refused naming the range seen: clipped, it trained on white."""
    low, high = image.min().item(), image.max().item()
    if not -FLOAT_OVERSHOOT <= low <= high <= 1 + FLOAT_OVERSHOOT:
        raise BadItem(
            f"invalid {FLAG}: {where}'s image holds floats from {low:.3g} to {high:.3g}, not in "
            "[0, 1]: return ToTensor's floats in [0, 1] or uint8 pixels, not normalised (ddpcli "
            "normalises)"
        )
    return (image.clamp(0, 1) * 255).round().to(torch.uint8)


def checked_label(label: Any, num_classes: int, where: str) -> int:
    try:
        value = int(label)
    except (TypeError, ValueError):
        value = -1
    if isinstance(label, float) or not 0 <= value < num_classes:
        raise BadItem(
            f"invalid {FLAG}: {where}'s label must be a class index 0..{num_classes - 1} (one "
            f"per class name); it is {label!r}"
        )
    return value


class CustomDataset(KeyedImages):
    """A user's data set on the loader path: each item checked and made uint8 (3, H, W),
    then augmented and viewed exactly as an image folder's images are."""

    def __init__(
        self, dataset: Any, split: str, spec: str, num_classes: int, image_size: int,
        seed: int, augment: Augment,
    ) -> None:  # fmt: skip
        super().__init__(seed, augment, image_size)
        self.dataset, self.split, self.spec, self.num_classes = dataset, split, spec, num_classes

    def __len__(self) -> int:
        return len(self.dataset)

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = item_of(self.dataset, index, self.split, self.spec)
        where = f"{self.spec} {self.split} item {index}"
        return as_uint8_image(image, where), checked_label(label, self.num_classes, where)

    def centred(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.load(index)
        return centre_view(image, self.image_size), label
