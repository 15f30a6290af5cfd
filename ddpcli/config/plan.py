"""What one training run resolved, as a type: `RunPlan`.

`TrainConfig` is the request: the flags, the recipe and the launcher's variables, validated
once and never rewritten. `RunPlan` is the same settings with every "auto" settled against
this machine (devices, model, image sides, run folder, optimiser defaults) and what the
launcher found (the precision and why, where the world came from, the resume file it checked,
the peak learning rate at the global batch). One function makes it before any worker starts,
`ddpcli.launcher.plan.plan_run`; each rank settles what only it can know once, in
`ddpcli.training.settle`. Its fields dump under the request's names, so `config.json` and a
checkpoint's `config` read as they always did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from ddpcli.config.facts import RunFacts
from ddpcli.config.train import LrScaling, TrainConfig, describe_lr, scaled_lr


class RunPlan(RunFacts, TrainConfig):
    """The request's settings, settled (what was "auto", None, has its value), and what the
    run found (RunFacts). Frozen, as the request is."""

    per_gpu_batch: int  # with batch_auto: each process's share of the global batch
    arch: str
    image_size: int
    augment: Literal["rrc", "crop-flip", "none"]
    decode: Literal["cpu", "gpu"]
    train_crop_size: int
    val_resize_size: int
    val_crop_size: int
    out: Path
    lr: float
    lr_scaling: LrScaling
    weight_decay: float

    def peak_lr_at(self, world_size: int, micro_batches_per_epoch: int | None = None) -> float:
        """--lr scaled by --lr-scaling to this run's global batch (see `scaled_lr`)."""
        global_batch = self.global_batch_at(world_size, micro_batches_per_epoch)
        return scaled_lr(self.lr, global_batch, self.lr_base_batch, self.lr_scaling)

    def describe_lr_at(self, world_size: int, micro_batches_per_epoch: int | None = None) -> str:
        global_batch = self.global_batch_at(world_size, micro_batches_per_epoch)
        return describe_lr(self.lr, global_batch, self.lr_base_batch, self.lr_scaling)
