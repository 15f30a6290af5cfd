"""The training loop: epochs, steps, accumulation, validation and metric reduction.

It reads like the algorithm: get batch, forward, backward, step, log. Devices, data,
checkpoints and output each live in their own module; this one only orchestrates.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpcli import ui
from ddpcli.checkpoint.init import load_initial_weights
from ddpcli.checkpoint.schema import (
    TrainingParts,
    TrainState,
    find_resume_path,
    global_batch_of,
    load_training_checkpoint,
    restore_training,
    resume_warnings,
    training_payload,
    world_change_line,
)
from ddpcli.checkpoint.writer import CheckpointWriter, write_metrics_history
from ddpcli.config import TrainConfig
from ddpcli.config.train import OPTIMIZER_DEFAULTS
from ddpcli.data.mixing import BatchMixing, build_mixing
from ddpcli.data.pipeline import DataPipeline
from ddpcli.data.resharding import samples_trained
from ddpcli.data.sets import SKIPPED_IMAGES_FILE
from ddpcli.dist import DistContext, all_reduce_max, all_reduce_sum, barrier
from ddpcli.errors import DdpcliError, agreed_error, runtime_error
from ddpcli.files import write_text_atomic
from ddpcli.models.build import build_model
from ddpcli.outputs.rankload import (
    METRIC_SLOTS,
    RankClock,
    rank_figures,
    rank_seconds,
    slots_for,
    straggler_note,
)
from ddpcli.outputs.steplog import StepLog
from ddpcli.timing import synced_clock, synchronize
from ddpcli.training.ema import WeightAverage, adjusted_decay, slow_average_warning
from ddpcli.training.param_groups import weight_decay_groups
from ddpcli.training.precision import has_tf32
from ddpcli.training.stopping import SUMMARY_FILE, Interrupted, Preemption, stop_record
from ddpcli.training.strategy import AUTOCAST_DTYPES, batch_split, model_devices, unwrap, wrap_model
from ddpcli.training.syncbn import convert_sync_batchnorm

TIMING_WARMUP_STEPS = 3  # the first steps pay for allocation and autotuning; not timed


# --- Building the parts --------------------------------------------------------------------


def build_parallel_model(cfg: TrainConfig, ctx: DistContext, num_classes: int) -> nn.Module:
    torch.manual_seed(cfg.seed)  # identical initial weights everywhere (DDP also broadcasts)
    model = build_model(cfg.resolved_arch, num_classes, cfg.model_args).to(ctx.device)
    if cfg.sync_bn and ctx.distributed:
        model = convert_sync_batchnorm(model, ctx.device)
    if ctx.device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return wrap_model(model, cfg, ctx)


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """SGD or AdamW at the run's peak rate: --lr scaled to the global batch (`peak_lr`)."""
    # No weight decay on biases, and on norms only --norm-weight-decay: the BN-net recipe.
    groups = weight_decay_groups(model, cfg.resolved_weight_decay, cfg.norm_weight_decay)
    lr = cfg.resolved_peak_lr
    # One fused kernel for the whole update, on GPUs and on the CPU alike: on the CPU
    # foreach is the slowest choice (measured in docs/performance.md).
    try:
        return make_optimizer(cfg, groups, lr, fused=True)
    except (RuntimeError, ValueError):  # an older torch without a fused kernel for this device
        return make_optimizer(cfg, groups, lr)


def make_optimizer(
    cfg: TrainConfig, groups: list[dict[str, Any]], lr: float, **fused: bool
) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        betas = cfg.betas or [0.9, 0.999]
        return torch.optim.AdamW(groups, lr=lr, betas=(betas[0], betas[1]), **fused)
    return torch.optim.SGD(groups, lr=lr, momentum=cfg.resolved_momentum, nesterov=True, **fused)


def describe_optimizer(cfg: TrainConfig) -> str:
    """`sgd (nesterov momentum 0.9, weight decay 0.0005)`; AdamW's with its betas, and
    whether --lr-scaling is its default."""
    decay = f"weight decay {cfg.resolved_weight_decay:g}"
    if cfg.optimizer != "adamw":
        return f"sgd (nesterov momentum {cfg.resolved_momentum:g}, {decay})"
    betas = ", ".join(f"{beta:g}" for beta in cfg.betas or [])
    scaling = cfg.resolved_lr_scaling
    default = OPTIMIZER_DEFAULTS["adamw"]["lr_scaling"]
    rule = f"--lr-scaling {scaling}" + (", adamw's default" if scaling == default else "")
    return f"adamw (betas {betas}, {decay}; {rule})"


def warmup_cosine(total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def use_peak_lr(scheduler: torch.optim.lr_scheduler.LambdaLR, peak_lr: float) -> None:
    """Make PEAK_LR the schedule's base rate, and the current rate follow from it.

    A restored scheduler carries the base rate of the run that saved it; resumed with
    another global batch, this run's scaled rate must win from the next step on."""
    scheduler.base_lrs = [peak_lr] * len(scheduler.optimizer.param_groups)
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = peak_lr
        group["lr"] = peak_lr * factor(scheduler.last_epoch)


def autocast_context(cfg: TrainConfig, ctx: DistContext) -> AbstractContextManager[object]:
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


def describe_precision(precision: str, device: torch.device, reason: str | None = None) -> str:
    """`bf16 (auto: the CPU has AMX-BF16 and resnet18 is conv/matmul-bound)`: what runs and,
    when --precision auto chose it, why."""
    notes = [reason] if reason else []
    if precision == "fp32" and has_tf32(device):
        notes.append("TF32 tensor cores in matmuls and convolutions")
    return f"{precision} ({'; '.join(notes)})" if notes else precision


# --- The loop ------------------------------------------------------------------------------


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: DistContext, data: DataPipeline) -> None:
        self.cfg, self.ctx, self.data = cfg, ctx, data
        configure_cuda_math(cfg.precision, ctx.device)
        self.model = build_parallel_model(cfg, ctx, data.splits.num_classes)
        self.forward_model = torch.compile(self.model) if cfg.compile else self.model
        self.optimizer = build_optimizer(cfg, self.model)
        self.micro_total = data.steps_per_epoch()  # micro-batches per epoch on each rank
        self.steps_per_epoch = math.ceil(self.micro_total / cfg.accumulate)
        # What one optimizer step really holds: an epoch shorter than --accumulate caps it.
        self.accumulate = min(cfg.accumulate, self.micro_total)
        self.global_batch = cfg.global_batch_at(ctx.world_size, self.micro_total)
        # The schedule spans --epochs; --max-steps only stops the run early, at a point a
        # later --resume continues from exactly as if it had never stopped.
        self.total_steps = cfg.epochs * self.steps_per_epoch
        warmup = round(cfg.warmup_epochs * self.steps_per_epoch)
        self.warmup_steps = min(warmup, self.total_steps // 2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_cosine(self.total_steps, self.warmup_steps)
        )
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.precision == "fp16")
        # Takes class indices, or the soft targets Mixup/CutMix make.
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        self.mixing: BatchMixing | None = build_mixing(cfg, data.splits.num_classes)
        self.ema = self.build_ema()
        self.state = TrainState()
        self.first_step_pending = True
        self.writer = CheckpointWriter(cfg, ctx)
        self.out = cfg.resolved_out
        self.saved_step: int | None = None  # the step of the newest checkpoint in --out
        self.finite_step = 0  # the last step at which the loss was checked and finite
        self.steplog = StepLog(self.out, ctx.is_main, tensorboard=cfg.tensorboard)
        self.preemption = Preemption(
            cfg.preempt_signal, every_steps=cfg.log_every, on_terminate=self.record_termination
        )
        # This rank's data wait and own compute (ddpcli.outputs.rankload).
        self.clock = RankClock(unwrap(self.model), hook_forward=not cfg.compile)

    def build_ema(self) -> WeightAverage | None:
        cfg = self.cfg
        if not cfg.ema:
            return None
        decay = adjusted_decay(cfg.ema_decay, self.global_batch, cfg.ema_steps, cfg.epochs)
        return WeightAverage(unwrap(self.model), decay, cfg.ema_steps, self.warmup_steps)

    # --- checkpoints
    def parts(self) -> TrainingParts:
        return TrainingParts(
            unwrap(self.model), self.optimizer, self.scheduler, self.scaler, self.ema
        )

    def save_checkpoint(self, name: str, is_best: bool) -> None:
        """Callers check the weights first (check_weights): last.pt must stay a good one."""
        num_classes = self.data.splits.num_classes
        payload = training_payload(self.parts(), self.state, self.cfg, self.ctx, num_classes)
        self.writer.save(payload, name, is_best=is_best)
        self.saved_step = self.state.step

    def resume(self, path: Path) -> None:
        payload = load_training_checkpoint(path, map_location=self.ctx.device)
        self.state = restore_training(payload, self.parts(), self.ctx, path, self.cfg.per_gpu_batch)
        saved_batch = global_batch_of(payload.get("config") or {}, payload["world_size"])
        if saved_batch != self.global_batch:  # the restored step count is in the old steps
            self.scheduler.last_epoch = self.schedule_position()
        use_peak_lr(self.scheduler, self.cfg.resolved_peak_lr)
        self.finite_step = self.state.step
        if path.resolve() == (self.writer.directory / "last.pt").resolve():
            self.saved_step = self.state.step
        if self.ctx.is_main:
            self.announce_resume(payload, path)

    def schedule_position(self) -> int:
        """The optimizer steps this run's global batch takes to where the restored epoch
        stands, so that warm-up and cosine end where the run ends after a world change."""
        state, cfg = self.state, self.cfg
        done = samples_trained(
            state.epoch_start, state.batch_in_epoch, cfg.per_gpu_batch, self.ctx.world_size
        )
        return state.epoch * self.steps_per_epoch + round(done / self.global_batch)

    def announce_resume(self, payload: dict[str, Any], path: Path) -> None:
        """Rank 0: where the run goes on, what a new world changed, and how it deals the
        rest of the interrupted epoch."""
        state, world_size = self.state, self.ctx.world_size
        config = json.loads(self.cfg.model_dump_json())
        for warning in resume_warnings(payload, config, world_size):
            ui.warn(warning)
        where = f"epoch {state.epoch + 1}" + (
            f", batch {state.batch_in_epoch}" if state.batch_in_epoch else ""
        )
        ui.info(f"resumed from {path} at {where} (step {state.step})")
        if line := world_change_line(payload, config, world_size):
            ui.info(line)
        if state.epoch_start and state.epoch < self.cfg.epochs:
            ui.info(self.data.describe_rest(state.epoch, state.epoch_start))

    def start_from_weights(self, path: Path) -> None:
        """--init-from: every rank loads the same file into its replica before step 1."""
        num_classes = self.data.splits.num_classes
        report = load_initial_weights(
            unwrap(self.model), path, num_classes, self.cfg.reset_head, self.ctx.device
        )
        if self.ctx.is_main:
            ui.info(report.line())

    # --- training
    def fit(self) -> dict[str, Any]:
        resume_path = self.agreed_resume_path()
        if resume_path:  # the resumed weights replace any --init-from ones
            self.resume(resume_path)
        else:
            if self.cfg.resume == "auto" and self.ctx.is_main:
                ui.info(
                    "--resume auto: no checkpoints/last.pt in the output folder; starting fresh"
                )
            if self.cfg.init_from is not None:
                self.start_from_weights(self.cfg.init_from)
        last = self.state.history[-1] if self.state.history else {}
        if not self.work_left():
            return last
        if self.ctx.is_main:  # each epoch once, even if the interrupted run wrote one more
            write_metrics_history(self.out / "metrics.jsonl", self.state.history)
        self.steplog.start(self.state.step)
        self.announce()
        progress = ui.TrainProgress(self.ctx.is_main, self.cfg.epochs, self.data.steps_per_epoch())
        try:
            with progress, self.steplog, self.preemption:
                while self.work_goes_on():
                    last = self.run_epoch(progress)
                    if self.state.batch_in_epoch < self.epoch_micro_batches():
                        self.stop_inside_epoch(last)
                    else:
                        self.finish_epoch(last)
        except KeyboardInterrupt:  # Ctrl-C: rank 0's launcher says where, once
            raise Interrupted(self.stop_record("interrupted")) from None
        if self.preemption.agreed and self.state.epoch < self.cfg.epochs:
            return {**last, **self.stop_record("preempted")}
        return last

    def work_goes_on(self) -> bool:
        state = self.state
        if state.epoch >= self.cfg.epochs or self.reached_max_steps():
            return False
        return not self.preemption.stop_now(state.step, self.ctx, boundary=True)

    def stop_record(self, reason: str) -> dict[str, Any]:
        state = self.state
        return stop_record(
            reason, state.epoch + 1, state.step, self.saved_step, self.steps_per_epoch, self.out
        )

    def record_termination(self) -> None:
        """A SIGTERM that is not the preemption signal ends every rank now, unsaved: rank 0
        leaves where the run stopped, for the launcher's one line."""
        if not self.ctx.is_main:
            return
        record = {**self.stop_record("terminated"), "preempt_signal": self.preemption.signal_name}
        write_text_atomic(self.out / SUMMARY_FILE, ui.json_text(record) + "\n")

    def work_left(self) -> bool:
        """False, said on rank 0, when a resume finds the work done: not a silent exit 0,
        and its outputs (metrics.jsonl too) stay as they are."""
        state, cfg = self.state, self.cfg
        if state.epoch >= cfg.epochs:
            reason = f"all {cfg.epochs} epochs are done; raise --epochs to train more"
        elif self.reached_max_steps():
            reason = (
                f"--max-steps {cfg.max_steps} is reached (step {state.step}, inside epoch "
                f"{state.epoch + 1}); raise or drop --max-steps to go on"
            )
        else:
            return True
        if self.ctx.is_main:
            ui.warn(f"nothing to train: {reason}")
        return False

    def agreed_resume_path(self) -> Path | None:
        """Every rank must resume from the same place. With `--resume auto` and an `--out`
        that is local to each node, node 0 may find last.pt where node 1 does not; training
        on anyway would desynchronise the ranks, so say what to do instead."""
        path = find_resume_path(self.cfg)
        found = float(path is not None)
        # One collective: the max of (found, -found) is (anyone found, -(everyone found)).
        extremes = torch.tensor([found, -found], device=self.ctx.device)
        anyone, minus_everyone = all_reduce_max(extremes, self.ctx).tolist()
        everyone = -minus_everyone
        if anyone != everyone:
            raise runtime_error(
                f"rank {self.ctx.rank}: {'found' if path else 'did not find'} the checkpoint to "
                f"resume from ({self.cfg.resume}) but other ranks did not agree; put --out (or "
                "the --resume file) on a file system every node shares"
            )
        return path

    def micro_batches_to_run(self, micro_total: int) -> int:
        """The micro-batches this epoch will run: fewer than it holds when --max-steps stops
        it inside (its timing window is planned on these, or a short run times nothing)."""
        left = micro_total - self.state.batch_in_epoch
        if self.cfg.max_steps is None:
            return left
        return min(left, (self.cfg.max_steps - self.state.step) * self.cfg.accumulate)

    def reached_max_steps(self) -> bool:
        return self.cfg.max_steps is not None and self.state.step >= self.cfg.max_steps

    def announce(self) -> None:
        if not self.ctx.is_main:
            return
        cfg = self.cfg
        if cfg.world_from:
            ui.info(f"world from {cfg.world_from}")
        ui.info(
            f"world size {self.ctx.world_size} ({self.ctx.backend}, {self.ctx.device.type}) · "
            f"per-process batch {cfg.per_gpu_batch} × world {self.ctx.world_size} × "
            f"accumulate {self.accumulate} = global batch {self.global_batch}"
        )
        ui.info(
            f"{describe_optimizer(cfg)} · "
            f"{cfg.describe_lr_at(self.ctx.world_size, self.micro_total)} · linear warm-up "
            f"{self.warmup_steps} "
            f"steps, cosine decay to 0 at step {self.total_steps}"
        )
        if note := self.accumulation_note():
            ui.warn(note)
        ui.info(
            f"{cfg.arch} on {cfg.dataset} at {cfg.image_size} px · {self.data.describe_sizes()} · "
            f"{self.steps_per_epoch} steps per epoch · "
            f"precision {describe_precision(cfg.precision, self.ctx.device, cfg.precision_reason)}"
            f" · out {cfg.out}"
        )
        ui.info(
            f"strategy {cfg.strategy} · data path {self.data.path_name} · "
            f"compile {'on' if cfg.compile else 'off'}{self.split_note()}"
        )
        if ingredients := ingredients_line(cfg, self.ema):
            ui.info(ingredients)
        if self.ema is not None and (
            warning := slow_average_warning(
                self.ema.decay, self.ema.every_steps, self.warmup_steps, self.total_steps
            )
        ):
            ui.warn(warning)
        skipped = self.data.splits.skipped
        if skipped:
            ui.warn(
                f"--skip-bad-images: left out {len(skipped)} image(s) that cannot be decoded "
                f"({', '.join(skipped[:3])}{', ...' if len(skipped) > 3 else ''}); all of them "
                f"in {self.out / SKIPPED_IMAGES_FILE}"
            )

    def accumulation_note(self) -> str:
        """Where the optimizer steps hold fewer micro-batches than --accumulate says."""
        accumulate, micro = self.cfg.accumulate, self.micro_total
        if accumulate > micro:
            return (
                f"--accumulate {accumulate}, but an epoch has only {micro} micro-batch(es) per "
                f"rank: each optimizer step accumulates {micro} (global batch "
                f"{self.global_batch}, not {self.cfg.global_batch})"
            )
        if micro % accumulate:
            return (
                f"{micro} micro-batches per epoch is not a multiple of --accumulate {accumulate}: "
                f"each epoch's last optimizer step accumulates {micro % accumulate}"
            )
        return ""

    def epoch_micro_batches(self) -> int:
        """This epoch's micro-batches per rank: a whole epoch's, or (re-dealt at a new world)
        those of its rest (ddpcli.data.resharding)."""
        return self.data.steps_per_epoch(self.state.epoch_start)

    def micro_batches_in_step(self, batch_in_epoch: int) -> int:
        """The micro-batches the optimizer step holding micro-batch `batch_in_epoch`
        (1-based) accumulates: --accumulate, or what is left of the epoch. The loss is
        divided by it, so every step averages its gradients whatever its length."""
        step_start = (batch_in_epoch - 1) // self.cfg.accumulate * self.cfg.accumulate
        return min(self.cfg.accumulate, self.epoch_micro_batches() - step_start)

    def split_note(self) -> str:
        cfg = self.cfg
        if cfg.strategy == "ddp":
            return ""
        gpus = len(model_devices(self.model, self.ctx))
        shares = batch_split(cfg.strategy, cfg.per_gpu_batch, gpus, cfg.gpu0_batch)
        note = f" · each batch of {cfg.per_gpu_batch} split {'+'.join(map(str, shares))}"
        if self.accumulate > 1:
            per_step = "+".join(str(share * self.accumulate) for share in shares)
            note += f" ({per_step} per optimizer step)"
        return note + f" over {gpus} GPUs"

    def run_epoch(self, progress: ui.TrainProgress) -> dict[str, Any]:
        cfg, ctx, state = self.cfg, self.ctx, self.state
        self.model.train()
        # loss, correct, count; then each rank's [data wait, compute] seconds (rankload)
        sums = torch.zeros(slots_for(ctx.world_size), device=ctx.device, dtype=torch.float64)
        if state.partial_sums and ctx.is_main:
            partial = torch.tensor(state.partial_sums, device=ctx.device, dtype=torch.float64)
            sums[:METRIC_SLOTS] += partial
        self.steplog.start_epoch(state.partial_sums)
        self.clock.start_epoch()
        steps_before = state.step
        state.partial_sums = None
        batches = self.data.train_batches(
            state.epoch, skip_batches=state.batch_in_epoch, start=state.epoch_start
        )
        micro_total = self.epoch_micro_batches()
        timer = StepTimer(ctx.device, self.micro_batches_to_run(micro_total))
        first_step_at = None
        progress.start_epoch(state.epoch, state.batch_in_epoch)
        for images, labels in self.clock.waited(batches):
            state.batch_in_epoch += 1
            last_micro = state.batch_in_epoch == micro_total
            steps_now = state.batch_in_epoch % cfg.accumulate == 0 or last_micro
            accumulated = self.micro_batches_in_step(state.batch_in_epoch)
            images, targets = self.mixed(images, labels)
            self.train_micro_step(images, labels, sums, steps_now, accumulated, targets)
            timer.tick(len(labels))
            if steps_now:
                state.step += 1
                if self.ema is not None:
                    self.ema.after_step(unwrap(self.model), state.step)
                if self.first_step_pending:  # one device sync per run, for "time to first step"
                    first_step_at, self.first_step_pending = synced_time(ctx.device), False
                self.after_optimizer_step(sums, progress, timer, last_micro)
                if self.reached_max_steps() or self.preemption.stop_now(state.step, ctx):
                    break
        totals = self.reduce_sums(sums)
        wait_s, compute_s = rank_seconds(totals[METRIC_SLOTS:])
        ranks = rank_figures(
            wait_s, compute_s, self.clock.epoch_seconds(), state.step - steps_before
        )
        if state.batch_in_epoch < micro_total:  # stopped inside: what a resume adds to
            state.partial_sums = totals[:METRIC_SLOTS]
        train_loss, train_acc = means(totals)
        images_per_sec = timer.images_per_sec(ctx)
        preempted_inside = self.preemption.agreed and state.batch_in_epoch < micro_total
        if preempted_inside:  # a scheduler's grace is short: save first, the resume validates
            val_loss, val_acc, val_samples, ema_metrics = None, None, None, {}
        else:
            val_loss, val_acc, val_samples = self.validate(unwrap(self.model))
            ema_metrics = self.validate_ema()
        return {
            "epoch": state.epoch + 1,
            "step": state.step,
            "train_loss": train_loss,
            "train_acc": train_acc,
            "val_loss": val_loss,
            "val_acc": val_acc,
            "val_samples": val_samples,
            **ema_metrics,
            "images_per_sec": images_per_sec,
            "lr": self.scheduler.get_last_lr()[0],
            "peak_lr": cfg.peak_lr,
            "global_batch": self.global_batch,
            "world_size": ctx.world_size,
            "data_path": self.data.path_name,
            **ranks,
            **self.memory_metrics(),
            **({"first_step_at": first_step_at} if first_step_at else {}),
        }

    def memory_metrics(self) -> dict[str, list[float]]:
        """Peak memory so far: per GPU on CUDA (by rank with DDP, by GPU with dp), and the
        host's peak resident set per rank (what a CPU run uses)."""
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        metrics = {"peak_rss_mb": per_rank(rss_mb, self.ctx)}
        if self.ctx.device.type == "cuda":
            devices = model_devices(self.model, self.ctx)
            peaks = [torch.cuda.max_memory_allocated(device) / 2**20 for device in devices]
            metrics["peak_memory_mb"] = (
                [round(peak, 1) for peak in peaks]
                if len(peaks) > 1
                else per_rank(peaks[0], self.ctx)
            )
        return metrics

    def mixed(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With Mixup/CutMix: the mixed batch and its soft targets, drawn from (seed, epoch,
        micro-batch, rank) alone; else the batch and its labels."""
        if self.mixing is None:
            return images, labels
        key = self.state.batch_in_epoch * self.ctx.world_size + self.ctx.rank
        return self.mixing(images, labels, self.state.epoch, key)

    def gradient_sync(self, steps_now: bool) -> AbstractContextManager[object]:
        """Gradients are all-reduced only on the micro-step that steps the optimizer."""
        if not steps_now and isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def train_micro_step(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        sums: torch.Tensor,
        steps_now: bool,
        accumulated: int,
        targets: torch.Tensor,
    ) -> None:
        """TARGETS: LABELS, or Mixup/CutMix's soft targets (accuracy counts LABELS)."""
        self.clock.compute_started()
        with self.gradient_sync(steps_now):
            with autocast_context(self.cfg, self.ctx):
                logits = self.forward_model(images)
                loss = self.loss_fn(logits, targets)
            self.scaler.scale(loss / accumulated).backward()
        self.clock.backward_done()
        with torch.no_grad():
            sums[0] += loss.detach().double() * len(labels)
            sums[1] += (logits.argmax(1) == labels).sum()
            sums[2] += len(labels)
        if steps_now:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        self.clock.compute_done(steps_now)

    def after_optimizer_step(
        self,
        sums: torch.Tensor,
        progress: ui.TrainProgress,
        timer: StepTimer,
        last_micro: bool,
    ) -> None:
        state, cfg = self.state, self.cfg
        logs_now = state.step % cfg.log_every == 0 or last_micro
        # At the epoch's end, or at --max-steps, the run saves anyway.
        every = cfg.save_every_steps
        saves_now = bool(every) and state.step % (every or 1) == 0
        saves_now = saves_now and not last_micro and not self.reached_max_steps()
        # steps.jsonl also gets a row where a resume may start (a save, --max-steps), so
        # that its rows cover every step once, however often the run is resumed.
        if not (logs_now or saves_now or self.reached_max_steps()):
            return
        totals = self.reduce_sums(sums)
        self.log_step(totals)
        if logs_now:
            rate = timer.running_rate(self.ctx)
            progress.update(state.batch_in_epoch, *means(totals), rate, self.steplog.last_row)
        if saves_now:
            state.partial_sums = totals[:METRIC_SLOTS]
            self.check_weights()
            self.save_checkpoint(f"step-{state.step:08d}.pt", is_best=False)
            state.partial_sums = None

    def log_step(self, totals: list[float]) -> None:
        state = self.state
        position = {
            "step": state.step,
            "epoch": state.epoch + 1,
            "epoch_fraction": self.epoch_fraction(),
        }
        self.steplog.record(position, totals, float(self.scheduler.get_last_lr()[0]))

    def epoch_fraction(self) -> float:
        state = self.state
        if not state.epoch_start:
            return state.batch_in_epoch / self.micro_total
        if state.batch_in_epoch >= self.epoch_micro_batches():  # the tail folded in: all done
            return 1.0
        batch, world = self.cfg.per_gpu_batch, self.ctx.world_size
        done = samples_trained(state.epoch_start, state.batch_in_epoch, batch, world)
        return done / self.data.train_size

    def reduce_sums(self, sums: torch.Tensor) -> list[float]:
        """The epoch's [loss sum, correct, count] so far, over all ranks, then every rank's
        data wait and compute seconds. Every rank gets the same sums, so a non-finite loss
        stops every rank at the same step."""
        self.clock.write(sums, self.ctx.rank)
        total = all_reduce_sum(sums.clone(), self.ctx).tolist()
        self.check_finite("the training loss", total[0])
        return total

    # --- non-finite values: stop before they reach a checkpoint
    def check_finite(self, what: str, value: float) -> None:
        if not math.isfinite(value):
            raise self.non_finite_stop(f"{what} is {value}")
        self.finite_step = self.state.step

    def check_weights(self) -> None:
        """Before a save. The losses checked so far came before the last update, which may
        still have made the weights non-finite. One small all_reduce per save, so that
        every rank stops (or not) together."""
        tensors = [t for t in unwrap(self.model).state_dict().values() if t.is_floating_point()]
        finite = torch.stack([t.isfinite().all() for t in tensors]).all() if tensors else True
        flag = torch.tensor([0.0 if finite else 1.0], device=self.ctx.device)
        if all_reduce_max(flag, self.ctx).item() != 0:
            raise self.non_finite_stop("a weight is not finite")

    def non_finite_stop(self, finding: str) -> DdpcliError:
        """Exit 1 naming the step; last.pt and best.pt stay at the last good save."""
        state, cfg = self.state, self.cfg
        when = f"at step {state.step}"
        if self.finite_step < state.step - 1:  # seen at a logging interval, not at once
            when = f"between step {self.finite_step} and step {state.step}"
        where = (
            f"epoch {state.epoch + 1}, batch {state.batch_in_epoch} of {self.epoch_micro_batches()}"
        )
        if self.saved_step is None:
            kept = "no checkpoint had been saved yet"
        else:
            kept = f"checkpoints/last.pt and best.pt are kept as they were (step {self.saved_step})"
        hint = f"a lower --lr (this run: {cfg.lr:g})"
        if cfg.precision in ("fp16", "bf16"):
            hint += f" or full precision (--precision fp32; this run: {cfg.precision})"
        return agreed_error(
            f"{finding} {when} ({where}): training stopped; {kept}. Start again with {hint}"
        )

    def validate_ema(self) -> dict[str, float]:
        """The EMA weights validated beside the raw ones: `ema_val_loss`, `ema_val_acc`."""
        if self.ema is None:
            return {}
        loss, acc, _ = self.validate(self.ema.module)
        return {"ema_val_loss": loss, "ema_val_acc": acc}

    @torch.no_grad()
    def validate(self, model: nn.Module) -> tuple[float, float, int]:
        """Every validation sample counted once: strided shards, no padding, one all_reduce.
        MODEL is unwrapped, so ranks with one batch fewer never wait on a collective."""
        model.eval()
        sums = torch.zeros(3, device=self.ctx.device, dtype=torch.float64)
        for images, labels in self.data.val_batches():
            with autocast_context(self.cfg, self.ctx):
                logits = model(images)
                loss = nn.functional.cross_entropy(logits, labels, reduction="sum")
            sums[0] += loss.double()
            sums[1] += (logits.argmax(1) == labels).sum()
            sums[2] += len(labels)
        model.train()
        total = all_reduce_sum(sums, self.ctx).tolist()
        if not math.isfinite(total[0]):
            raise self.non_finite_stop(f"the validation loss is {total[0]}")
        count = max(total[2], 1.0)
        return total[0] / count, total[1] / count, int(total[2])

    def finish_epoch(self, metrics: dict[str, Any]) -> None:
        self.check_weights()
        state = self.state
        state.history.append(metrics)
        is_best = self.record_best(metrics)
        state.epoch += 1
        state.batch_in_epoch = state.epoch_start = 0
        if self.ctx.is_main:
            with open(self.out / "metrics.jsonl", "a") as handle:
                handle.write(ui.json_text(metrics) + "\n")
            self.steplog.epoch_end(metrics)
            ui.epoch_line(metrics, self.cfg.epochs)
            if note := straggler_note(metrics):
                ui.warn(f"epoch {metrics['epoch']}: {note}")
        self.save_checkpoint(f"epoch-{state.epoch:04d}.pt", is_best=is_best)
        barrier(self.ctx)

    def record_best(self, metrics: dict[str, Any]) -> bool:
        """best.pt follows the weights a user would deploy: the EMA's when --ema is on."""
        accuracy = metrics.get("ema_val_acc", metrics["val_acc"])
        if accuracy is None:  # not validated (a preemption inside the epoch)
            return False
        is_best = accuracy > self.state.best_val_acc
        self.state.best_val_acc = max(self.state.best_val_acc, accuracy)
        return is_best

    def stop_inside_epoch(self, metrics: dict[str, Any]) -> None:
        """--max-steps (or a preemption) stopped the run inside an epoch. Its checkpoint holds
        the epoch, the batches done and the partial sums (as a --save-every-steps one does), so
        a resume finishes the epoch exactly; the metrics of the part trained are marked partial and
        stay out of the history, so the resume's rewrite of metrics.jsonl replaces them."""
        self.check_weights()
        state = self.state
        metrics.update(partial=True, batch_in_epoch=state.batch_in_epoch)
        is_best = self.record_best(metrics)
        if self.ctx.is_main:
            with open(self.out / "metrics.jsonl", "a") as handle:
                handle.write(ui.json_text(metrics) + "\n")
            preempted = self.preemption.agreed
            how = self.preemption.signal_name if preempted else f"--max-steps {self.cfg.max_steps}"
            ui.info(
                f"epoch {metrics['epoch']}/{self.cfg.epochs}, stopped by {how} after batch "
                f"{state.batch_in_epoch} of {self.epoch_micro_batches()} · "
                f"{ui.format_metrics(metrics)}"
                + ("" if preempted else f"; --out {self.out} --resume auto with --max-steps "
                   "raised or dropped finishes it")
            )  # fmt: skip
        self.save_checkpoint(f"step-{state.step:08d}.pt", is_best=is_best)
        state.partial_sums = None


def ingredients_line(cfg: TrainConfig, ema: WeightAverage | None) -> str:
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


def means(totals: list[float]) -> tuple[float, float]:
    """Mean loss and accuracy from global [loss sum, correct, count]."""
    count = max(totals[2], 1.0)
    return totals[0] / count, totals[1] / count


def per_rank(value: float, ctx: DistContext) -> list[float]:
    """One value from every rank, in rank order (one small all_reduce)."""
    values = torch.zeros(ctx.world_size, device=ctx.device, dtype=torch.float64)
    values[ctx.rank] = value
    return [round(v, 1) for v in all_reduce_sum(values, ctx).tolist()]


def synced_time(device: torch.device) -> float:
    """Wall-clock (Unix) time once the device has finished the work queued so far."""
    synchronize(device)
    return time.time()


class StepTimer:
    """Images per second over the epoch's steps after the first few, summed over ranks.
    Synchronises the device only at the window's edges, never per step."""

    def __init__(self, device: torch.device, planned_steps: int) -> None:
        self.device = device
        self.warmup = min(TIMING_WARMUP_STEPS, planned_steps // 2)
        self.seen = 0
        self.images = 0
        self.start: float | None = synced_clock(device) if self.warmup == 0 else None

    def tick(self, batch_images: int) -> None:
        self.seen += 1
        if self.seen == self.warmup:
            self.start = synced_clock(self.device)
        elif self.seen > self.warmup:
            self.images += batch_images

    def running_rate(self, ctx: DistContext) -> float | None:
        if self.start is None or not self.images:
            return None
        return self.images * ctx.world_size / max(time.perf_counter() - self.start, 1e-9)

    def images_per_sec(self, ctx: DistContext) -> float | None:
        """None when no step was timed (a preemption within the first steps): 0 would read as
        a stalled run."""
        elapsed = synced_clock(self.device) - self.start if self.start is not None else 0.0
        images = all_reduce_sum(torch.tensor([float(self.images)], device=ctx.device), ctx)
        slowest = all_reduce_max(torch.tensor([elapsed], device=ctx.device), ctx)
        if not images.item():
            return None
        return float(images.item() / max(slowest.item(), 1e-9))
