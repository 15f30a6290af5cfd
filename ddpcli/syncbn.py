"""--sync-bn: BatchNorm statistics over the global batch, every rank's samples together.

On GPUs, torch's own `nn.SyncBatchNorm.convert_sync_batchnorm` converts the model. Its
statistics kernels (`batch_norm_stats`, ...) exist for GPUs only, and DDP refuses an
nn.SyncBatchNorm on the CPU, so on Gloo CPU ranks each BatchNorm layer becomes a
GlooSyncBatchNorm instead: the same statistics from two differentiable all_reduces, so a
CPU run trains what a GPU run trains.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class _SummedOverRanks(torch.autograd.Function):
    """all_reduce (sum) that autograd sees through: the gradient of a sum over ranks is the
    sum of every rank's gradient (torch.distributed.nn's, which torch now deprecates)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        summed = tensor.clone()
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = grad.clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed, None


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return _SummedOverRanks.apply(tensor, group)


class GlooSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over every rank's samples, on any device: the mean first, then the
    variance around it (two passes: E[x^2] - E[x]^2 loses precision in float32). Autograd
    flows through the all_reduces, so each rank's gradient sees every rank's samples, as
    torch's GPU kernels arrange by hand. Not an nn.SyncBatchNorm: DDP refuses those on
    the CPU."""

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
        count = input.new_tensor([input.numel() // channels])
        sums = all_reduce(torch.cat([input.sum(dims), count]), group=group)
        total = sums[-1]
        mean = sums[:-1] / total
        centred = input - mean.view(shape)
        var = all_reduce(centred.square().sum(dims), group=group) / total
        self._track(mean.detach(), var.detach(), total.item())
        output = centred * torch.rsqrt(var + self.eps).view(shape)
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
