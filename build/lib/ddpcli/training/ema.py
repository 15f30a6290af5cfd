"""--ema: an exponential moving average of the weights, as torchvision's classification
reference keeps it (`utils.ExponentialMovingAverage`): torch.optim.swa_utils' AveragedModel
with its EMA rule, BatchNorm buffers averaged too, updated every --ema-steps optimizer
steps, and copied instead of averaged while the learning rate warms up."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def adjusted_decay(decay: float, global_batch: int, ema_steps: int, epochs: int) -> float:
    """torchvision's adjustment: the decay --ema-decay names holds for one image per epoch
    per update; a run updating every EMA_STEPS steps of GLOBAL_BATCH images over EPOCHS
    scales 1 - decay by global_batch x ema_steps / epochs (capped at copying the weights)."""
    alpha = min(1.0, (1.0 - decay) * global_batch * ema_steps / epochs)
    return 1.0 - alpha


def slow_average_warning(
    decay: float, every_steps: int, warmup_steps: int, total_steps: int
) -> str:
    """A warning when the average cannot move in this run: after its last update more than
    half of it would still be the weights the warm-up ended with (decay^updates > 0.5), as
    the reference's decay, made for 600 epochs, does on a short schedule. "" otherwise."""
    updates = max(0, total_steps - warmup_steps) // every_steps
    kept = decay**updates
    if kept <= 0.5:
        return ""
    half_life = math.log(0.5) / math.log(decay) if 0 < decay < 1 else math.inf
    return (
        f"--ema: at decay {decay:.6g} (adjusted) the average makes {updates} update(s) after "
        f"the warm-up and would still be {100 * kept:.0f}% the weights the warm-up ended "
        f"with (its half-life is {half_life:.0f} updates); lower --ema-decay or raise --epochs"
    )


class WeightAverage:
    """The averaged copy of MODEL (the unwrapped module) and when to update it."""

    def __init__(self, model: nn.Module, decay: float, every_steps: int, warmup_steps: int):
        self.averaged = AveragedModel(
            model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True
        )
        self.decay, self.every_steps, self.warmup_steps = decay, every_steps, warmup_steps

    @property
    def module(self) -> nn.Module:
        return self.averaged.module

    @torch.no_grad()
    def after_step(self, model: nn.Module, step: int) -> None:
        """STEP: optimizer steps taken so far (1-based)."""
        if step % self.every_steps:
            return
        self.averaged.update_parameters(model)
        if step <= self.warmup_steps:  # the reference's reset: keep copying while warming up
            self.averaged.n_averaged.fill_(0)

    def state_dict(self) -> dict[str, Any]:
        return self.averaged.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None, model: nn.Module) -> None:
        """STATE from a checkpoint; None (one saved without --ema) starts from MODEL."""
        if state is None:
            self.averaged.module.load_state_dict(model.state_dict())
            self.averaged.n_averaged.fill_(0)
        else:
            self.averaged.load_state_dict(state)
