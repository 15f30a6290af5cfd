"""Where a run stands and where it goes: the micro-batches of an epoch and of an optimizer
step, the learning-rate schedule over --epochs (linear warm-up, cosine decay), where
--max-steps stops the run, and where the schedule stands after a resume at another world.

The schedule spans --epochs; --max-steps only stops the run early, at a point a later
--resume continues from exactly as if it had never stopped. Positions are a TrainState
(ddpcli.checkpoint.schema), read here and never changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ddpcli.checkpoint.schema import TrainState
from ddpcli.config.plan import RunPlan
from ddpcli.data.pipeline import DataPath
from ddpcli.data.resharding import samples_trained


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


class Schedule:
    """The run's steps at this world: fixed once the data is dealt."""

    def __init__(self, cfg: RunPlan, world_size: int, data: DataPath) -> None:
        self.cfg, self.world_size, self.data = cfg, world_size, data
        self.micro_total = data.steps_per_epoch()  # micro-batches per epoch on each rank
        self.steps_per_epoch = math.ceil(self.micro_total / cfg.accumulate)
        # What one optimizer step really holds: an epoch shorter than --accumulate caps it.
        self.accumulate = min(cfg.accumulate, self.micro_total)
        self.global_batch = cfg.global_batch_at(world_size, self.micro_total)
        self.total_steps = cfg.epochs * self.steps_per_epoch
        warmup = round(cfg.warmup_epochs * self.steps_per_epoch)
        self.warmup_steps = min(warmup, self.total_steps // 2)

    def lr_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, warmup_cosine(self.total_steps, self.warmup_steps)
        )

    def follow_resume(
        self,
        scheduler: torch.optim.lr_scheduler.LambdaLR,
        state: TrainState,
        saved_batch: int | str,
    ) -> None:
        """A restored scheduler counts the steps of the global batch it was saved at: at
        another one it moves to where STATE stands in this run's steps; this run's peak rate
        wins either way."""
        if saved_batch != self.global_batch:
            scheduler.last_epoch = self.steps_to(state)
        use_peak_lr(scheduler, self.cfg.peak_lr)

    def steps_to(self, state: TrainState) -> int:
        """The optimizer steps this run's global batch takes to where STATE's epoch stands,
        so that warm-up and cosine end where the run ends after a world change."""
        done = samples_trained(
            state.epoch_start, state.batch_in_epoch, self.cfg.per_gpu_batch, self.world_size
        )
        return state.epoch * self.steps_per_epoch + round(done / self.global_batch)

    def describe(self) -> str:
        """`linear warm-up 32 steps, cosine decay to 0 at step 160`, and where --max-steps
        stops the run when it stops before that."""
        line = (
            f"linear warm-up {self.warmup_steps} steps, "
            f"cosine decay to 0 at step {self.total_steps}"
        )
        max_steps = self.cfg.max_steps
        if max_steps is not None and max_steps < self.total_steps:
            line += f"; --max-steps stops at step {max_steps}"
        return line

    def accumulation_note(self) -> str:
        """Where the optimizer steps hold fewer micro-batches than --accumulate says."""
        accumulate, micro = self.cfg.accumulate, self.micro_total
        if accumulate > micro:
            return (
                f"--accumulate {accumulate}, but an epoch has only {micro} micro-batch(es) per "
                f"rank: each optimizer step accumulates {micro} (global batch "
                f"{self.global_batch}, not {self.cfg.planned_global_batch})"
            )
        if micro % accumulate:
            return (
                f"{micro} micro-batches per epoch is not a multiple of --accumulate {accumulate}: "
                f"each epoch's last optimizer step accumulates {micro % accumulate}"
            )
        return ""

    # --- positions inside an epoch
    def epoch_micro_batches(self, state: TrainState) -> int:
        """STATE's epoch's micro-batches per rank: a whole epoch's, or (re-dealt at a new
        world) those of its rest (ddpcli.data.resharding)."""
        return self.data.steps_per_epoch(state.epoch_start)

    def micro_batches_in_step(self, state: TrainState, batch_in_epoch: int) -> int:
        """The micro-batches the optimizer step holding micro-batch `batch_in_epoch`
        (1-based) accumulates: --accumulate, or what is left of the epoch. The loss is
        divided by it, so every step averages its gradients whatever its length."""
        accumulate = self.cfg.accumulate
        step_start = (batch_in_epoch - 1) // accumulate * accumulate
        return min(accumulate, self.epoch_micro_batches(state) - step_start)

    def micro_batches_to_run(self, state: TrainState) -> int:
        """The micro-batches STATE's epoch will run: fewer than it holds when --max-steps
        stops it inside (its timing window is planned on these, or a short run times
        nothing)."""
        left = self.epoch_micro_batches(state) - state.batch_in_epoch
        if self.cfg.max_steps is None:
            return left
        return min(left, (self.cfg.max_steps - state.step) * self.cfg.accumulate)

    def reached_max_steps(self, state: TrainState) -> bool:
        return self.cfg.max_steps is not None and state.step >= self.cfg.max_steps

    def epoch_fraction(self, state: TrainState) -> float:
        """How much of STATE's epoch is trained, as steps.jsonl records it."""
        if not state.epoch_start:
            return state.batch_in_epoch / self.micro_total
        if state.batch_in_epoch >= self.epoch_micro_batches(state):  # the tail folded in: all done
            return 1.0
        batch, world = self.cfg.per_gpu_batch, self.world_size
        done = samples_trained(state.epoch_start, state.batch_in_epoch, batch, world)
        return done / self.data.train_size
