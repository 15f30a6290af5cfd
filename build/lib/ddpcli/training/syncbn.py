"""--sync-bn: BatchNorm statistics over the global batch, every rank's samples together.

On GPUs, torch's own `nn.SyncBatchNorm.convert_sync_batchnorm` converts the model. Its
statistics kernels (`batch_norm_stats`, ...) exist for GPUs only, and DDP refuses an
nn.SyncBatchNorm on the CPU, so on Gloo CPU ranks each BatchNorm layer becomes a
GlooSyncBatchNorm instead: the same statistics from one differentiable all_gather, so a
CPU run trains what a GPU run trains.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class _GatheredFromRanks(torch.autograd.Function):
    """all_gather that autograd sees through: row r of the result is rank r's tensor. Every
    rank's loss depends on every row, so a row's gradient is the sum of all ranks' gradients
    for it: one all_reduce in the backward, as torch.distributed.nn's (which torch now
    deprecates)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, tensor.contiguous(), group=group)
        return torch.stack(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed[dist.get_rank(ctx.group)], None


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _GatheredFromRanks.apply(tensor, group)


class GlooSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over every rank's samples, on any device, with one collective each way:
    every rank sends its count, mean and variance (one all_gather), and
    each rank combines them as Chan et al.'s parallel variance does (no E[x^2] - E[x]^2,
    which loses precision in float32). Autograd flows through the gather, so each rank's
    gradient sees every rank's samples, as torch's GPU kernels arrange by hand. Not an
    nn.SyncBatchNorm: DDP refuses those on the CPU."""

    process_group: dist.ProcessGroup | None = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized()):
            return super().forward(input)
        group = self.process_group or dist.group.WORLD
        # Statistics in float32 under bf16 autocast, as torch's BatchNorm keeps them (and its
        # running buffers); the output in the input's precision, as torch's.
        given, input = input, input.float()
        channels = input.shape[1]
        dims = [0, *range(2, input.ndim)]
        shape = [1, channels] + [1] * (input.ndim - 2)
        # torch.var_mean's per-rank figures are as exact as BatchNorm's own; the global mean
        # is taken as a shift from rank 0's, so a large mean does not swamp a small spread.
        local_var, local_mean = torch.var_mean(input, dims, correction=0)
        count = input.new_tensor([input.numel() // channels])
        ranks = all_gather(torch.cat([local_mean, local_var, count]), group)
        means, variances, counts = ranks[:, :channels], ranks[:, channels:-1], ranks[:, -1:]
        total = counts.sum()
        mean = means[0] + (counts * (means - means[0])).sum(0) / total
        var = (counts * (variances + (means - mean).square())).sum(0) / total
        self._track(mean.detach(), var.detach(), total.item())
        output = (input - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        return output.to(given.dtype)

    @torch.no_grad()
    def _track(self, mean: torch.Tensor, var: torch.Tensor, total: float) -> None:
        """Running statistics as nn.BatchNorm keeps them: the unbiased variance."""
        if not self.track_running_stats or self.running_mean is None or self.running_var is None:
            return
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # a cumulative average
            factor = 1.0 / float(self.num_batches_tracked.item())
        else:
            factor = self.momentum
        self.running_mean.lerp_(mean, factor)
        self.running_var.lerp_(var * total / max(total - 1, 1.0), factor)


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """torch's conversion on GPUs; on the CPU each BatchNorm layer becomes, in place, a
    GlooSyncBatchNorm (same parameters, buffers and state-dict keys: checkpoints do not
    care which device trained them)."""
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.__class__ = GlooSyncBatchNorm  # keeps the layer's tensors as they are
    return model
