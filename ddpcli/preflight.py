"""The user's own code, run once in the launcher before any worker starts: a custom model is
imported, built on the CPU and given one batch; a custom data set is built and its first
items looked at; `--init-from` weights are fitted to the model. Whatever is wrong then ends
the command with exit 2 and one line, not N ranks with N tracebacks.

Plain torchvision and built-in names skip all this: their start stays as quick as it was.
"""

from __future__ import annotations

from typing import Any

from ddpcli.config import TrainConfig
from ddpcli.factories import is_factory_spec, timm_model_name

BUILTIN_CLASSES = {"synthetic": 10, "stl10": 10}


def needs_preflight(cfg: TrainConfig) -> bool:
    arch = cfg.resolved_arch
    return bool(
        is_factory_spec(arch)
        or timm_model_name(arch) is not None
        or cfg.model_args
        or cfg.custom_dataset
        or cfg.init_from
    )


def class_count(cfg: TrainConfig) -> int:
    """The classes of the data set the run trains on: the model's output width."""
    if cfg.custom_dataset:
        from ddpcli.data.custom import custom_splits

        return len(custom_splits(cfg).class_names)
    if cfg.dataset in BUILTIN_CLASSES:
        return BUILTIN_CLASSES[cfg.dataset]
    from ddpcli.data.layout import check_imagefolder

    return len(check_imagefolder(cfg.resolved_data_dir))


def preflight(cfg: TrainConfig) -> dict[str, Any]:
    """What --dry-run shows of the model (class, parameters), or {} when nothing to check."""
    if not needs_preflight(cfg):
        return {}
    import torch

    from ddpcli.models import build_model, check_model_output, parameter_count

    num_classes = class_count(cfg)
    torch.manual_seed(cfg.seed)
    with torch.device("cpu"):
        model = build_model(cfg.resolved_arch, num_classes, cfg.model_args)
    built: dict[str, Any] = {}
    if cfg.init_from is not None:  # a shape that does not fit: exit 2 now, not on every rank
        from ddpcli.checkpoint.init import load_initial_weights

        report = load_initial_weights(model, cfg.init_from, num_classes, cfg.reset_head)
        built["initial_weights"] = report.summary()
    check_model_output(model, cfg.resolved_arch, num_classes, cfg.resolved_image_size)
    kind = type(model)
    built.update(
        model_class=f"{kind.__module__}.{kind.__qualname__}",
        parameters=parameter_count(model),
        num_classes=num_classes,
    )
    return built
