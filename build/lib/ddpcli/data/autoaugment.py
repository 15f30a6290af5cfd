"""--auto-augment: torchvision.transforms.v2's TrivialAugmentWide, RandAugment or
AutoAugment (its ImageNet policy) on each uint8 training image after its crop and flip,
where torchvision's reference presets apply them.

Each image's draws (which operations, their magnitudes and signs) are the ones torchvision
makes, in its order, from a private generator seeded from (seed, epoch, key): a pure
function of them, so a resume, another rank or the other data path gives the image the
same operations, and no other random stream moves. The draws are made on the host; the
pixels are changed a batch at a time on the images' device, each operation once for the
images that drew it (the geometric ones together, in one grid_sample of a matrix per
image), with one copy queued from the host per operation slot and no wait for the device.
A batch of one (a loader worker's image) takes the same code.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F

from ddpcli.data.augment import STREAM_AUTO_AUGMENT, host_to_device, stream_generators

POLICIES = ("ta_wide", "randaugment", "autoaugment")

Op = tuple[str, float]  # torchvision's name of an operation, and its signed magnitude
IDENTITY: Op = ("Identity", 0.0)
GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")


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
    """uint8 (N, 3, H, W) -> uint8, each image through TRANSFORM's operations as drawn for
    its key (on a batch torchvision would draw once and apply one operation to every image)."""
    height, width = images.shape[-2:]
    generators = stream_generators(seed, epoch, keys, STREAM_AUTO_AUGMENT)
    drawn = [draw_ops(transform, generator, height, width) for generator in generators]
    mode = str(transform.interpolation.value)
    for slot in range(len(drawn[0]) if drawn else 0):  # a policy draws as many for every image
        images = apply_slot(images, [ops[slot] for ops in drawn], mode)
    return images


# --- Draws: torchvision's forward(), each random number from a private generator -----------


def draw_ops(transform: Any, generator: torch.Generator, height: int, width: int) -> list[Op]:
    """The operations TRANSFORM applies to one HEIGHT x WIDTH image, in order, drawn as its
    forward() draws them from the global generator (tests/test_recipe.py compares them)."""
    if hasattr(transform, "_policies"):  # AutoAugment: a sub-policy, each op with its chance
        policies = transform._policies
        ops = []
        for name, probability, magnitude_bin in policies[_randint(len(policies), generator)]:
            if not torch.rand((), generator=generator) <= probability:
                ops.append(IDENTITY)
                continue
            ops.append(
                _with_magnitude(transform, name, 10, magnitude_bin, generator, height, width)
            )
        return ops
    if hasattr(transform, "num_ops"):  # RandAugment: NUM_OPS ops at one fixed magnitude
        return [
            _with_magnitude(transform, _random_op(transform, generator),
                            transform.num_magnitude_bins, transform.magnitude, generator,
                            height, width)
            for _ in range(transform.num_ops)
        ]  # fmt: skip
    name = _random_op(transform, generator)  # TrivialAugmentWide: one op, a random magnitude
    bins = transform.num_magnitude_bins
    if _magnitudes(transform, name, bins, height, width) is None:
        return [(name, 0.0)]
    return [_with_magnitude(transform, name, bins, _randint(bins, generator), generator,
                            height, width)]  # fmt: skip


def _randint(high: int, generator: torch.Generator) -> int:
    return int(torch.randint(high, (), generator=generator))


def _random_op(transform: Any, generator: torch.Generator) -> str:
    names = tuple(transform._AUGMENTATION_SPACE)
    return names[_randint(len(names), generator)]


def _with_magnitude(
    transform: Any, name: str, bins: int, magnitude_bin: int | None,
    generator: torch.Generator, height: int, width: int,
) -> Op:  # fmt: skip
    magnitudes = _magnitudes(transform, name, bins, height, width)
    if magnitudes is None:
        return name, 0.0
    assert magnitude_bin is not None  # every policy op with magnitudes names its bin
    magnitude = magnitudes[magnitude_bin]
    signed = transform._AUGMENTATION_SPACE[name][1]
    if signed and torch.rand((), generator=generator) <= 0.5:
        magnitude = -magnitude
    return name, magnitude


@functools.lru_cache(maxsize=256)
def _magnitudes(
    transform: Any, name: str, bins: int, height: int, width: int
) -> tuple[float, ...] | None:
    """TRANSFORM's magnitude bins for NAME, as Python floats (torchvision builds the tensor
    anew for each image)."""
    values = transform._AUGMENTATION_SPACE[name][0](bins, height, width)
    return None if values is None else tuple(float(value) for value in values)


# --- Pixels: each operation once per batch, on the images' device --------------------------


def apply_slot(images: torch.Tensor, ops: list[Op], mode: str) -> torch.Tensor:
    """Image i of IMAGES through ops[i]. The images that drew the same operation go through
    it together; the geometric ones all at once."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for row, op in enumerate(ops):
        key = _group(op, *images.shape[-2:])
        if key is not None:
            groups.setdefault(key, []).append(row)
    if not groups:
        return images
    order = [row for rows in groups.values() for row in rows]
    if len(groups) == 1 and order == list(range(len(ops))):  # one image, or one operation
        return _apply_group(images, next(iter(groups)), [ops[row] for row in order], mode)
    device_order = host_to_device(torch.tensor(order), images.device)
    changed, start = images.clone(), 0
    for key, rows in groups.items():
        group = device_order[start : start + len(rows)]
        done = _apply_group(images.index_select(0, group), key, [ops[row] for row in rows], mode)
        changed.index_copy_(0, group, done)
        start += len(rows)
    return changed


def _group(op: Op, height: int, width: int) -> tuple[Any, ...] | None:
    """Which images share a call: None for an operation that leaves the image as it is."""
    name, magnitude = op
    if name == "Identity":
        return None
    if name == "Rotate":  # torchvision's own shortcuts for a quarter turn: exact pixels
        angle = magnitude % 360
        if angle == 0:
            return None
        if angle == 180 or (height == width and angle in (90, 270)):
            return ("quarter turns", int(angle) // 90)
    if name in GEOMETRIC:
        return ("affine",)
    return op


def _apply_group(images: torch.Tensor, key: tuple[Any, ...], ops: list[Op], mode: str):
    from torchvision.transforms.v2 import functional as TF

    name, magnitude = key[0], key[-1]
    if name == "quarter turns":
        return torch.rot90(images, k=magnitude, dims=(-2, -1))
    if name == "affine":
        return _affine(images, ops, mode)
    if name == "Brightness":
        return TF.adjust_brightness_image(images, 1.0 + magnitude)
    if name == "Color":
        return TF.adjust_saturation_image(images, 1.0 + magnitude)
    if name == "Contrast":
        return TF.adjust_contrast_image(images, 1.0 + magnitude)
    if name == "Sharpness":
        return _sharpen(images, 1.0 + magnitude)
    if name == "Posterize":
        return TF.posterize_image(images, int(magnitude))
    if name == "Solarize":
        return TF.solarize_image(images, 255 * magnitude)
    if name == "AutoContrast":
        return TF.autocontrast_image(images)
    if name == "Equalize":
        return TF.equalize_image(images)
    if name == "Invert":
        return TF.invert_image(images)
    raise ValueError(f"no operation {name!r} in torchvision's policies")


def _affine(images: torch.Tensor, ops: list[Op], mode: str) -> torch.Tensor:
    """torchvision's affine_image / rotate_image for each image by its own matrix, in one
    grid_sample: the same matrices, grid and rounding (its per-image version builds each
    matrix on the device from the host, a copy that waits for the device)."""
    count, _, height, width = images.shape
    matrices = [_inverse_matrix(op, height, width) for op in ops]
    theta = torch.tensor(matrices, dtype=torch.float32).view(count, 2, 3)
    theta = host_to_device(theta.transpose(1, 2) / torch.tensor([0.5 * width, 0.5 * height]),
                           images.device)  # fmt: skip
    base = torch.empty(1, height, width, 3, device=images.device)
    xs = torch.linspace((1.0 - width) * 0.5, (width - 1.0) * 0.5, steps=width, device=images.device)
    ys = torch.linspace((1.0 - height) * 0.5, (height - 1.0) * 0.5, steps=height,
                        device=images.device)  # fmt: skip
    base[..., 0].copy_(xs)
    base[..., 1].copy_(ys.unsqueeze(-1))
    base[..., 2].fill_(1)
    grid = base.view(1, height * width, 3).expand(count, -1, -1).bmm(theta)
    float_images = images.to(torch.float32)
    moved = F.grid_sample(float_images, grid.view(count, height, width, 2), mode=mode,
                          padding_mode="zeros", align_corners=False)  # fmt: skip
    return moved.round_().to(images.dtype)


def _inverse_matrix(op: Op, height: int, width: int) -> list[float]:
    """The inverse affine matrix torchvision's policy builds for OP (see
    _AutoAugmentBase._apply_image_or_video_transform), in Python floats as it does."""
    from torchvision.transforms.v2.functional._geometry import _get_inverse_affine_matrix

    name, magnitude = op
    corner = [-0.5 * width, -0.5 * height]  # center=[0, 0]: the top-left corner
    if name == "ShearX":
        shear = [math.degrees(math.atan(magnitude)), 0.0]
        return _get_inverse_affine_matrix(corner, 0.0, [0.0, 0.0], 1.0, shear)
    if name == "ShearY":
        shear = [0.0, math.degrees(math.atan(magnitude))]
        return _get_inverse_affine_matrix(corner, 0.0, [0.0, 0.0], 1.0, shear)
    if name == "TranslateX":
        return _get_inverse_affine_matrix([0.0, 0.0], 0.0, [float(int(magnitude)), 0.0], 1.0,
                                          [0.0, 0.0])  # fmt: skip
    if name == "TranslateY":
        return _get_inverse_affine_matrix([0.0, 0.0], 0.0, [0.0, float(int(magnitude))], 1.0,
                                          [0.0, 0.0])  # fmt: skip
    return _get_inverse_affine_matrix([0.0, 0.0], -(magnitude % 360), [0.0, 0.0], 1.0, [0.0, 0.0])


def _sharpen(images: torch.Tensor, factor: float) -> torch.Tensor:
    """torchvision's adjust_sharpness_image, its kernel made on the device (it copies one
    from the host for each call)."""
    height, width = images.shape[-2:]
    if height <= 2 or width <= 2:
        return images
    kernel = torch.full((3, 3), 1.0 / 13.0, device=images.device)
    kernel[1, 1].fill_(5.0 / 13.0)
    output = images.to(torch.float32, copy=True)
    # Channels-last: the CPU's depthwise convolution of a batch is several times faster so.
    # Each blurred value is a whole number of thirteenths, never within 1/26 of a half, so
    # rounding gives torchvision's blur whatever order the sums are taken in.
    blurred = F.conv2d(output.contiguous(memory_format=torch.channels_last),
                       kernel.expand(3, 1, 3, 3), groups=3).round_()  # fmt: skip
    inner = output[..., 1:-1, 1:-1]
    inner.add_(blurred.sub_(inner), alpha=1.0 - factor)
    return output.clamp_(0, 255).to(images.dtype)
