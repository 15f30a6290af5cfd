"""Which parameters weight decay applies to, in optimizer parameter groups.

Weights of convolutions and linear layers decay at --weight-decay; other 1-d parameters
(biases) never do; normalisation layers' weights and biases decay at --norm-weight-decay,
torchvision's reference `set_weight_decay` (0 by default, as torchvision's v2 recipe has it).
"""

from __future__ import annotations

from typing import Any

from torch import nn

# The layers torchvision's reference counts as normalisation layers.
NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
)


def norm_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters that belong to normalisation layers."""
    return {
        id(parameter)
        for module in model.modules()
        if isinstance(module, NORM_LAYERS)
        for parameter in module.parameters(recurse=False)
    }


def weight_decay_groups(
    model: nn.Module, weight_decay: float, norm_weight_decay: float
) -> list[dict[str, Any]]:
    """Parameter groups. With no norm decay the two groups ddpcli always had (decay, no
    decay), so that checkpoints of earlier runs still resume; else a third for the norms."""
    norms = norm_parameters(model) if norm_weight_decay else set()
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    norm: list[nn.Parameter] = []
    for parameter in model.parameters():
        if id(parameter) in norms:
            norm.append(parameter)
        else:
            (no_decay if parameter.ndim <= 1 else decay).append(parameter)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if norm_weight_decay:
        groups.append({"params": norm, "weight_decay": norm_weight_decay})
    return groups
