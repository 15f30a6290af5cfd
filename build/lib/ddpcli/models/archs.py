"""Model names `--arch` accepts, checked without importing torch or torchvision.

The launcher checks the name before it starts any worker, so a typo fails in a moment
with exit 2; importing torchvision there only to list its models would slow every run's
start (docs/performance.md). The workers build the model (ddpcli.models.build).
"""

from __future__ import annotations

from ddpcli.errors import usage_error
from ddpcli.factories import check_timm_installed, is_factory_spec, timm_model_name

BUILTIN_ARCHS = ("smallcnn", "tinycnn")

# torchvision.models.list_models(module=torchvision.models) as of torchvision 0.29.
# A name not listed here is looked up in the installed torchvision, so models that
# newer releases add still work (at the cost of that import).
KNOWN_TORCHVISION_CLASSIFIERS = frozenset(
    {
        "alexnet",
        "convnext_base",
        "convnext_large",
        "convnext_small",
        "convnext_tiny",
        "densenet121",
        "densenet161",
        "densenet169",
        "densenet201",
        "efficientnet_b0",
        "efficientnet_b1",
        "efficientnet_b2",
        "efficientnet_b3",
        "efficientnet_b4",
        "efficientnet_b5",
        "efficientnet_b6",
        "efficientnet_b7",
        "efficientnet_v2_l",
        "efficientnet_v2_m",
        "efficientnet_v2_s",
        "googlenet",
        "inception_v3",
        "maxvit_t",
        "mnasnet0_5",
        "mnasnet0_75",
        "mnasnet1_0",
        "mnasnet1_3",
        "mobilenet_v2",
        "mobilenet_v3_large",
        "mobilenet_v3_small",
        "regnet_x_16gf",
        "regnet_x_1_6gf",
        "regnet_x_32gf",
        "regnet_x_3_2gf",
        "regnet_x_400mf",
        "regnet_x_800mf",
        "regnet_x_8gf",
        "regnet_y_128gf",
        "regnet_y_16gf",
        "regnet_y_1_6gf",
        "regnet_y_32gf",
        "regnet_y_3_2gf",
        "regnet_y_400mf",
        "regnet_y_800mf",
        "regnet_y_8gf",
        "resnet101",
        "resnet152",
        "resnet18",
        "resnet34",
        "resnet50",
        "resnext101_32x8d",
        "resnext101_64x4d",
        "resnext50_32x4d",
        "shufflenet_v2_x0_5",
        "shufflenet_v2_x1_0",
        "shufflenet_v2_x1_5",
        "shufflenet_v2_x2_0",
        "squeezenet1_0",
        "squeezenet1_1",
        "swin_b",
        "swin_s",
        "swin_t",
        "swin_v2_b",
        "swin_v2_s",
        "swin_v2_t",
        "vgg11",
        "vgg11_bn",
        "vgg13",
        "vgg13_bn",
        "vgg16",
        "vgg16_bn",
        "vgg19",
        "vgg19_bn",
        "vit_b_16",
        "vit_b_32",
        "vit_h_14",
        "vit_l_16",
        "vit_l_32",
        "wide_resnet101_2",
        "wide_resnet50_2",
    }
)


def installed_torchvision_classifiers() -> list[str]:
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def check_arch(name: str) -> None:
    """A name torchvision or ddpcli knows; `timm:NAME` with timm installed. A factory
    (`pkg.module:factory`) is checked where it is imported and built (ddpcli.training.preflight)."""
    if is_factory_spec(name):
        return
    if timm_model_name(name) is not None:
        check_timm_installed()
        return
    if name in BUILTIN_ARCHS or name in KNOWN_TORCHVISION_CLASSIFIERS:
        return
    if name in installed_torchvision_classifiers():
        return
    examples = ", ".join([*BUILTIN_ARCHS, "resnet18", "resnet50", "mobilenet_v3_small"])
    raise usage_error(
        f"invalid --arch: unknown model {name!r}; use a torchvision classifier name, a "
        f"built-in one (e.g. {examples}), timm:NAME or your own pkg.module:factory"
    )
