"""Architecture registry: small built-in nets for CPU work, torchvision's classifiers,
timm's models (`timm:NAME`, when timm is installed) and a user's own factory
(`pkg.module:factory`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ddpcli.errors import first_line, usage_error
from ddpcli.factories import (
    call_factory,
    check_timm_installed,
    is_factory_spec,
    load_factory,
    timm_model_name,
)
from ddpcli.models.archs import check_arch


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


def build_model(
    name: str, num_classes: int, model_args: Mapping[str, Any] | None = None
) -> nn.Module:
    """The model `--arch NAME` names, with `--model-arg` keywords passed to its constructor."""
    arguments = {**(model_args or {}), "num_classes": num_classes}
    if is_factory_spec(name):
        return custom_model(name, arguments)
    timm_name = timm_model_name(name)
    if timm_name is not None:
        return timm_model(timm_name, arguments)
    check_arch(name)
    try:
        if name in BUILTIN_MODELS:
            return BUILTIN_MODELS[name](**arguments)
        import torchvision

        return torchvision.models.get_model(name, weights=None, **arguments)
    except TypeError as error:  # a --model-arg the constructor does not take
        raise usage_error(f"invalid --model-arg for --arch {name}: {first_line(error)}") from None


def custom_model(spec: str, arguments: dict[str, Any]) -> nn.Module:
    model = call_factory(load_factory(spec, "--arch"), spec, "--arch", **arguments)
    if not isinstance(model, nn.Module):
        raise usage_error(
            f"invalid --arch: {spec} returned a value of type {type(model).__name__}, not a "
            "torch.nn.Module; "
            "the factory must return the model"
        )
    return model


def timm_model(name: str, arguments: dict[str, Any]) -> nn.Module:
    check_timm_installed()
    import timm

    if not timm.is_model(name):
        raise usage_error(
            f'invalid --arch: timm has no model {name!r}; `python -c "import timm; '
            f"print(timm.list_models('{name[:4]}*'))\"` lists similar names"
        )
    return call_factory(timm.create_model, f"timm.create_model({name!r})", "--arch", **{
        "model_name": name, **arguments
    })  # fmt: skip


def parameter_count(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def check_model_output(model: nn.Module, arch: str, num_classes: int, image_size: int) -> None:
    """One forward pass of two images on the CPU: the output must be (batch, num_classes)."""
    images = torch.zeros(2, 3, image_size, image_size)
    model.eval()
    try:
        with torch.no_grad():
            output = model(images)
    except Exception as error:
        raise usage_error(
            f"invalid --arch: {arch} fails on a batch of shape (2, 3, {image_size}, {image_size}): "
            f"{type(error).__name__}: {first_line(error)}"
        ) from None
    finally:
        model.train()
    if not isinstance(output, torch.Tensor) or tuple(output.shape) != (2, num_classes):
        got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise usage_error(
            f"invalid --arch: {arch} must return logits of shape (batch, num_classes) = "
            f"(2, {num_classes}) for 2 images; it returned {got}"
        )
