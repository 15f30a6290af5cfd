"""The user's own code, run once in the launcher before any worker starts: a custom model is
imported, built on the CPU and given one batch, then one training step's forward and
backward (DDP needs a gradient for every trainable parameter); a custom data set is built
and its first items looked at; `--init-from` weights are fitted to the model. Whatever is
wrong then ends the command with exit 2 and one line, not N ranks with N tracebacks.

Plain torchvision and built-in names skip all this: their start stays as quick as it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddpcli.config.plan import RunPlan
from ddpcli.errors import usage_error
from ddpcli.factories import is_factory_spec, timm_model_name

if TYPE_CHECKING:  # torch is imported when a check runs, not with this module
    from torch import nn

BUILTIN_CLASSES = {"synthetic": 10, "stl10": 10}
UNUSED_NAMED = 4  # parameters named in the message; the count says how many more


def needs_preflight(cfg: RunPlan) -> bool:
    arch = cfg.arch
    return bool(
        is_factory_spec(arch)
        or timm_model_name(arch) is not None
        or cfg.model_args
        or cfg.custom_dataset
        or cfg.init_from
    )


def class_count(cfg: RunPlan) -> int:
    """The classes of the data set the run trains on: the model's output width."""
    if cfg.custom_dataset:
        from ddpcli.data.custom import custom_splits

        return len(custom_splits(cfg).class_names)
    if cfg.dataset in BUILTIN_CLASSES:
        return BUILTIN_CLASSES[cfg.dataset]
    from ddpcli.data.layout import check_imagefolder

    return len(check_imagefolder(cfg.data_folder))


def preflight(cfg: RunPlan) -> dict[str, Any]:
    """What --dry-run shows of the model (class, parameters), or {} when nothing to check."""
    if not needs_preflight(cfg):
        return {}
    import torch

    from ddpcli.models.build import build_model, check_model_output, parameter_count

    num_classes = class_count(cfg)
    torch.manual_seed(cfg.seed)
    with torch.device("cpu"):
        model = build_model(cfg.arch, num_classes, cfg.model_args)
    built: dict[str, Any] = {}
    if cfg.init_from is not None:  # a shape that does not fit: exit 2 now, not on every rank
        from ddpcli.checkpoint.init import load_initial_weights

        report = load_initial_weights(model, cfg.init_from, num_classes, cfg.reset_head)
        built["initial_weights"] = report.summary()
    check_model_output(model, cfg.arch, num_classes, cfg.image_size)
    check_trainable(model, cfg.arch)
    if cfg.strategy == "ddp" and not cfg.find_unused_parameters:
        check_every_parameter_used(model, cfg.arch, num_classes, cfg.image_size)
    kind = type(model)
    built.update(
        model_class=f"{kind.__module__}.{kind.__qualname__}",
        parameters=parameter_count(model),
        num_classes=num_classes,
    )
    return built


def check_trainable(model: nn.Module, arch: str) -> None:
    """Parameters the optimizer can train: else DDP refuses the model on every rank."""
    parameters = list(model.parameters())
    if not parameters:
        raise usage_error(
            f"invalid --arch: {arch} has no parameters: nothing to train; the factory must "
            "return a model with layers that learn (nn.Linear, nn.Conv2d, nn.Parameter)"
        )
    if not any(parameter.requires_grad for parameter in parameters):
        raise usage_error(
            f"invalid --arch: {arch} has no trainable parameters (all {len(parameters)} "
            "parameter tensors are frozen, requires_grad=False); leave some trainable, e.g. "
            "the head: model.head.requires_grad_(True)"
        )


def check_every_parameter_used(model: nn.Module, arch: str, num_classes: int, size: int) -> None:
    """One training step on two images: a trainable parameter that gets no gradient stops
    DDP at the second step, on every rank, with advice for its own API. A step that fails
    here is left for the run to report: this check is about unused parameters alone."""
    import torch

    images, labels = torch.randn(2, 3, size, size), torch.arange(2) % num_classes
    model.train()
    try:
        torch.nn.functional.cross_entropy(model(images).float(), labels).backward()
    except Exception:
        return
    unused = [
        name
        for name, parameter in model.named_parameters()
        if parameter.requires_grad and parameter.grad is None
    ]
    model.zero_grad(set_to_none=True)
    if unused:
        named = ", ".join(unused[:UNUSED_NAMED])
        more = f" and {len(unused) - UNUSED_NAMED} more" if len(unused) > UNUSED_NAMED else ""
        raise usage_error(
            f"invalid --arch: {arch} has parameters that take no part in the loss ({named}"
            f"{more}); DDP waits for their gradients: add --find-unused-parameters, or freeze "
            "them (requires_grad_(False)) or remove them"
        )
