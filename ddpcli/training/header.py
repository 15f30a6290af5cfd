"""The lines a run states on rank 0 before its first step: the world and the global batch,
the optimizer, rate and schedule, the model, data and precision, the strategy, the recipe's
ingredients, and what deserves a warning among them."""

from __future__ import annotations

import torch
from torch import nn

from ddpcli import ui
from ddpcli.config.plan import RunPlan
from ddpcli.config.train import OPTIMIZER_DEFAULTS
from ddpcli.data.pipeline import DataPath
from ddpcli.data.sets import SKIPPED_IMAGES_FILE
from ddpcli.dist import DistContext
from ddpcli.training.compression import describe_gradients, start_step_warning
from ddpcli.training.ema import WeightAverage, slow_average_warning
from ddpcli.training.graphs import describe_compile
from ddpcli.training.precision import has_tf32
from ddpcli.training.schedule import Schedule
from ddpcli.training.strategy import batch_split, model_devices


def announce_run(
    cfg: RunPlan,
    ctx: DistContext,
    schedule: Schedule,
    data: DataPath,
    model: nn.Module,
    ema: WeightAverage | None,
) -> None:
    if not ctx.is_main:
        return
    if cfg.world_from:
        ui.info(f"world from {cfg.world_from}")
    auto = " (auto: run in micro-batches that fit, found before the first step)"
    ui.info(
        f"world size {ctx.world_size} ({ctx.backend}, {ctx.device.type}) · "
        f"per-process batch {cfg.per_gpu_batch}{auto if cfg.batch_auto else ''}"
        f" × world {ctx.world_size} × "
        f"accumulate {schedule.accumulate} = global batch {schedule.global_batch}"
    )
    ui.info(
        f"{describe_optimizer(cfg)} · "
        f"{cfg.describe_lr_at(ctx.world_size, schedule.micro_total)} · {schedule.describe()}"
    )
    if note := schedule.accumulation_note():
        ui.warn(note)
    ui.info(
        f"{cfg.arch} on {cfg.dataset} at {cfg.image_size} px · {data.describe_sizes()} · "
        f"{schedule.steps_per_epoch} steps per epoch · "
        f"precision {describe_precision(cfg.precision, ctx.device, cfg.precision_reason)}"
        f" · out {cfg.out}"
    )
    ui.info(
        f"strategy {cfg.strategy} · data path {data.path_name} · "
        f"{describe_compile(cfg, ctx.device)}"
        f"{split_note(cfg, ctx, model, schedule.accumulate)}"
    )
    if streams := data.stream_line():  # --dataset shards: the order, streams and buffer
        ui.info(streams)
    if decode := data.decode_line():  # image files and shards: where their JPEGs decode
        ui.info(decode)
    announce_gradients(cfg, ctx, schedule, model)
    announce_ingredients(cfg, schedule, ema)
    if warning := skipped_images_warning(data.splits.skipped, cfg):
        ui.warn(warning)


def announce_gradients(
    cfg: RunPlan, ctx: DistContext, schedule: Schedule, model: nn.Module
) -> None:
    """DDP's all-reduce: what it sends per step, compressed or not, and DDP's settings."""
    if cfg.strategy != "ddp" or (ctx.world_size == 1 and cfg.grad_compression == "none"):
        return
    ui.info(describe_gradients(cfg, model, ctx.world_size))
    steps = min(schedule.total_steps, cfg.max_steps or schedule.total_steps)
    if warning := start_step_warning(cfg, steps):
        ui.warn(warning)


def announce_ingredients(cfg: RunPlan, schedule: Schedule, ema: WeightAverage | None) -> None:
    if ingredients := ingredients_line(cfg, ema):
        ui.info(ingredients)
    if ema is not None and (
        warning := slow_average_warning(
            ema.decay, ema.every_steps, schedule.warmup_steps, schedule.total_steps
        )
    ):
        ui.warn(warning)


def describe_optimizer(cfg: RunPlan) -> str:
    """`sgd (nesterov momentum 0.9, weight decay 0.0005)`; AdamW's with its betas, and
    whether --lr-scaling is its default."""
    decay = f"weight decay {cfg.weight_decay:g}"
    if cfg.optimizer != "adamw":
        return f"sgd (nesterov momentum {cfg.momentum or 0.0:g}, {decay})"
    betas = ", ".join(f"{beta:g}" for beta in cfg.betas or [])
    scaling = cfg.lr_scaling
    default = OPTIMIZER_DEFAULTS["adamw"]["lr_scaling"]
    rule = f"--lr-scaling {scaling}" + (", adamw's default" if scaling == default else "")
    return f"adamw (betas {betas}, {decay}; {rule})"


def describe_precision(precision: str, device: torch.device, reason: str | None = None) -> str:
    """`bf16 (auto: the CPU has AMX-BF16 and resnet18 is conv/matmul-bound)`: what runs and,
    when --precision auto chose it, why."""
    notes = [reason] if reason else []
    if precision == "fp32" and has_tf32(device):
        notes.append("TF32 tensor cores in matmuls and convolutions")
    return f"{precision} ({'; '.join(notes)})" if notes else precision


def split_note(cfg: RunPlan, ctx: DistContext, model: nn.Module, accumulate: int) -> str:
    """dp and balanced-dp: how each batch is shared out over the GPUs."""
    if cfg.strategy == "ddp":
        return ""
    gpus = len(model_devices(model, ctx))
    shares = batch_split(cfg.strategy, cfg.per_gpu_batch, gpus, cfg.gpu0_batch)
    note = f" · each batch of {cfg.per_gpu_batch} split {'+'.join(map(str, shares))}"
    if accumulate > 1:
        per_step = "+".join(str(share * accumulate) for share in shares)
        note += f" ({per_step} per optimizer step)"
    return note + f" over {gpus} GPUs"


def ingredients_line(cfg: RunPlan, ema: WeightAverage | None) -> str:
    """`recipe: sync-bn · EMA every 32 steps, decay 0.99... · ...`: the ingredients on."""
    parts = ["sync-bn"] if cfg.sync_bn else []
    if ema is not None:
        parts.append(f"EMA every {ema.every_steps} steps, decay {ema.decay:.6g} (adjusted)")
    mixing = [f"{name} {alpha:g}" for name, alpha in
              (("mixup", cfg.mixup_alpha), ("cutmix", cfg.cutmix_alpha)) if alpha]  # fmt: skip
    if mixing:
        parts.append(" / ".join(mixing))
    if cfg.auto_augment != "none":
        parts.append(cfg.auto_augment)
    if cfg.random_erase:
        parts.append(f"random erase {cfg.random_erase:g}")
    if cfg.ra_reps > 1:
        parts.append(f"ra-reps {cfg.ra_reps}")
    if cfg.norm_weight_decay:
        parts.append(f"norm weight decay {cfg.norm_weight_decay:g}")
    return "recipe: " + " · ".join(parts) if parts else ""


def skipped_images_warning(skipped: list[str], cfg: RunPlan) -> str:
    if not skipped:
        return ""
    return (
        f"--skip-bad-images: left out {len(skipped)} image(s) that cannot be decoded "
        f"({', '.join(skipped[:3])}{', ...' if len(skipped) > 3 else ''}); all of them "
        f"in {cfg.out / SKIPPED_IMAGES_FILE}"
    )
