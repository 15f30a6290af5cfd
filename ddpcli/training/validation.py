"""Validation at an epoch's end: every sample counted once (strided shards, no padding, one
all_reduce), the raw weights and, with --ema, the averaged ones beside them."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddpcli.config.plan import RunPlan
from ddpcli.data.pipeline import DataPath
from ddpcli.dist import DistContext, all_reduce_sum, broadcast_from_rank0
from ddpcli.training.ema import WeightAverage
from ddpcli.training.graphs import EvalForward
from ddpcli.training.parts import autocast_context

NOT_VALIDATED = {"val_loss": None, "val_acc": None, "val_samples": None}


class Validation:
    """NOT_FINITE turns a finding ("the validation loss is nan") into the error that stops
    every rank: the loop's, which says where the run stood."""

    def __init__(
        self,
        cfg: RunPlan,
        ctx: DistContext,
        data: DataPath,
        not_finite: Callable[[str], Exception],
        micro_batch: Callable[[], int | None] = lambda: None,
        forward: EvalForward | None = None,
    ) -> None:
        self.cfg, self.ctx, self.data = cfg, ctx, data
        self.not_finite = not_finite
        # --per-gpu-batch auto: the training micro-batch, which bounds validation's too.
        self.micro_batch = micro_batch
        # Eager, or under CUDA graphs the full batches in graphs (ddpcli.training.graphs).
        self.forward = forward or EvalForward(cfg.per_gpu_batch)

    def epoch_metrics(self, model: nn.Module, ema: WeightAverage | None) -> dict[str, Any]:
        """`val_loss`, `val_acc`, `val_samples`; with --ema, `ema_val_loss` and `ema_val_acc`
        too. MODEL is unwrapped, so ranks with one batch fewer never wait on a collective."""
        same_buffers_as_rank0(model, self.ctx)
        loss, accuracy, samples = self.validate(model)
        metrics: dict[str, Any] = {"val_loss": loss, "val_acc": accuracy, "val_samples": samples}
        if ema is not None:
            same_buffers_as_rank0(ema.module, self.ctx)
            ema_loss, ema_accuracy, _ = self.validate(ema.module)
            metrics.update(ema_val_loss=ema_loss, ema_val_acc=ema_accuracy)
        return metrics

    @torch.no_grad()
    def validate(self, model: nn.Module) -> tuple[float, float, int]:
        """Mean loss, accuracy and the samples counted, over every rank."""
        model.eval()
        sums = torch.zeros(3, device=self.ctx.device, dtype=torch.float64)
        for batch_images, batch_labels in self.data.val_batches():
            at_most = self.micro_batch() or len(batch_labels)
            for images, labels in zip(
                batch_images.split(at_most), batch_labels.split(at_most), strict=True
            ):
                with autocast_context(self.cfg, self.ctx):
                    logits = self.forward(model, images)  # a replay's: summed before the next
                    loss = nn.functional.cross_entropy(logits, labels, reduction="sum")
                sums[0] += loss.double()
                sums[1] += (logits.argmax(1) == labels).sum()
                sums[2] += len(labels)
        model.train()
        total = all_reduce_sum(sums, self.ctx).tolist()
        if not math.isfinite(total[0]):
            raise self.not_finite(f"the validation loss is {total[0]}")
        count = max(total[2], 1.0)
        return total[0] / count, total[1] / count, int(total[2])


def same_buffers_as_rank0(model: nn.Module, ctx: DistContext) -> None:
    """Each rank's BatchNorm statistics (and the EMA's, averaged from them) end the epoch
    updated by its own last batch: DDP hands out rank 0's only at the next forward. Rank 0's
    are the ones checkpoints save, so every rank validates with them: the figure is then
    the saved model's (what `ddpcli eval` measures), not a blend of each rank's copy."""
    broadcast_from_rank0(list(model.buffers()), ctx)
