"""The parts one rank trains with: the wrapped model, the optimizer, and the device math they
compute in (autocast, cuDNN's algorithm choice, TF32)."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from ddpcli.config.plan import RunPlan
from ddpcli.dist import DistContext
from ddpcli.models.build import build_model
from ddpcli.training.param_groups import weight_decay_groups
from ddpcli.training.strategy import AUTOCAST_DTYPES, ParallelModel, parallelize
from ddpcli.training.syncbn import convert_sync_batchnorm


def build_parallel_model(cfg: RunPlan, ctx: DistContext, num_classes: int) -> ParallelModel:
    torch.manual_seed(cfg.seed)  # identical initial weights everywhere (DDP also broadcasts)
    model = build_model(cfg.arch, num_classes, cfg.model_args).to(ctx.device)
    if cfg.sync_bn and ctx.distributed:
        model = convert_sync_batchnorm(model, ctx.device)
    if ctx.device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return parallelize(model, cfg, ctx)


def build_optimizer(cfg: RunPlan, model: nn.Module) -> torch.optim.Optimizer:
    """SGD or AdamW at the run's peak rate: --lr scaled to the global batch (`peak_lr`)."""
    # No weight decay on biases, and on norms only --norm-weight-decay: the BN-net recipe.
    groups = weight_decay_groups(model, cfg.weight_decay, cfg.norm_weight_decay)
    lr = cfg.peak_lr
    # One fused kernel for the whole update, on GPUs and on the CPU alike: on the CPU
    # foreach is the slowest choice (measured in docs/performance.md).
    try:
        return make_optimizer(cfg, groups, lr, fused=True)
    except (RuntimeError, ValueError):  # an older torch without a fused kernel for this device
        return make_optimizer(cfg, groups, lr)


def make_optimizer(
    cfg: RunPlan, groups: list[dict[str, Any]], lr: float, **fused: bool
) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        betas = cfg.betas or [0.9, 0.999]
        return torch.optim.AdamW(groups, lr=lr, betas=(betas[0], betas[1]), **fused)
    return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum or 0.0, nesterov=True, **fused)


def autocast_context(cfg: RunPlan, ctx: DistContext) -> AbstractContextManager[object]:
    dtype = AUTOCAST_DTYPES.get(cfg.precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=ctx.device.type, dtype=dtype)


def configure_cuda_math(precision: str, device: torch.device) -> None:
    """On CUDA: pick each convolution's algorithm once (the batch shapes are fixed: the last,
    partial training batch is dropped), and let fp32 runs use the tensor cores (TF32: fp32
    storage, a 10-bit mantissa inside matmuls and convolutions), as they would anywhere
    else on an Ampere or later GPU; the header says so."""
    if device.type != "cuda":
        return
    torch.backends.cudnn.benchmark = True
    if precision == "fp32":
        torch.set_float32_matmul_precision("high")  # torch's default keeps matmuls in IEEE fp32
        torch.backends.cudnn.allow_tf32 = True
