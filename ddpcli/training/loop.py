"""The training loop: epochs, steps, accumulation, and the stops on the way (an epoch's end,
--max-steps, a preemption, Ctrl-C, a non-finite loss or weight).

It reads like the algorithm: get batch, forward, backward, step, log. Its parts each live in
their own module with a narrow interface: the model and optimizer (`parts`), where the run
stands (`schedule`), validation (`validation`), what an epoch measures (`metrics`), the
checkpoints (`checkpointing`) and the header (`header`); this one only orchestrates.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpcli import ui
from ddpcli.checkpoint.schema import TrainingParts, TrainState
from ddpcli.checkpoint.writer import write_metrics_history
from ddpcli.collectives import record
from ddpcli.config.plan import RunPlan
from ddpcli.data.mixing import BatchMixing, build_mixing
from ddpcli.data.pipeline import DataPath
from ddpcli.dist import DistContext, all_reduce_max, all_reduce_sum, barrier
from ddpcli.errors import DdpcliError, agreed_error
from ddpcli.files import write_text_atomic
from ddpcli.outputs.rankload import (
    METRIC_SLOTS,
    RankClock,
    rank_figures,
    rank_seconds,
    slots_for,
    step_breakdown,
    straggler_note,
)
from ddpcli.outputs.steplog import StepLog
from ddpcli.outputs.summary import SUMMARY_FILE, RunSummary, StopRecord
from ddpcli.outputs.trackers.fanout import Trackers, run_opening
from ddpcli.training.checkpointing import Checkpointing
from ddpcli.training.ema import WeightAverage, adjusted_decay
from ddpcli.training.graphs import (
    compiled,
    eval_forward,
    graphs_apply,
    keep_gradients,
    prepare_profiler,
    step_begins,
)
from ddpcli.training.header import announce_run
from ddpcli.training.metrics import StepTimer, means, memory_metrics, synced_time
from ddpcli.training.microbatch import FakeOom, MicroBatches
from ddpcli.training.parts import (
    autocast_context,
    build_optimizer,
    build_parallel_model,
    configure_cuda_math,
)
from ddpcli.training.profiling import StepProfiler, step_profiler
from ddpcli.training.schedule import Schedule
from ddpcli.training.stopping import Interrupted, Preemption, stop_record
from ddpcli.training.strategy import unwrap
from ddpcli.training.validation import NOT_VALIDATED, Validation


class Trainer:
    def __init__(self, cfg: RunPlan, ctx: DistContext, data: DataPath) -> None:
        self.cfg, self.ctx, self.data = cfg, ctx, data
        configure_cuda_math(cfg.precision, ctx.device)
        parallel = build_parallel_model(cfg, ctx, data.splits.num_classes)
        self.model = parallel.model
        self.forward_model = compiled(self.model, cfg)
        self.optimizer = build_optimizer(cfg, self.model)
        # --compile-mode reduce-overhead or max-autotune on GPUs (ddpcli.training.graphs).
        self.graphs = graphs_apply(cfg, ctx.device)
        if self.graphs:
            keep_gradients(self.model)
            if cfg.profile_window is not None:
                prepare_profiler()
        self.schedule = Schedule(cfg, ctx.world_size, data)
        self.scheduler = self.schedule.lr_scheduler(self.optimizer)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.precision == "fp16")
        # Takes class indices, or the soft targets Mixup/CutMix make.
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        self.mixing: BatchMixing | None = build_mixing(cfg, data.splits.num_classes)
        self.ema = self.build_ema()
        # --per-gpu-batch auto: the share of each step run in micro-batches that fit.
        self.micro = self.build_micro_batches() if cfg.batch_auto else None
        self.fake_oom = FakeOom(cfg.fake_oom, ctx.rank)  # DDPCLI_FAKE_OOM, for the tests
        self.state = TrainState()
        self.first_step_pending = True
        parts = TrainingParts(
            unwrap(self.model),
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.ema,
            parallel.compression,  # the hook's state: the wrapped model's owner holds it
        )
        self.checkpoints = Checkpointing(cfg, ctx, data, parts, on_saved=self.checkpoint_saved)
        self.validation = Validation(
            cfg, ctx, data, self.non_finite_stop, lambda: self.micro.size if self.micro else None,
            eval_forward(cfg, ctx.device),
        )  # fmt: skip
        self.out = cfg.out
        self.finite_step = 0  # the last step at which the loss was checked and finite
        self.steplog = StepLog(self.out, ctx.is_main)
        self.trackers = Trackers([], {})  # rank 0's, once the run knows where it starts
        self.preemption = Preemption(
            cfg.preempt_signal, every_steps=cfg.log_every, on_terminate=self.record_termination
        )
        # This rank's data wait and own compute (ddpcli.outputs.rankload).
        self.clock = RankClock(unwrap(self.model), hook_forward=not cfg.compile)
        self.breakdown: dict[str, Any] = {}  # the last epoch's, per rank (rankload)
        self.profiler: StepProfiler | None = None  # --profile-steps's, once the run starts

    def build_ema(self) -> WeightAverage | None:
        cfg, schedule = self.cfg, self.schedule
        if not cfg.ema:
            return None
        decay = adjusted_decay(cfg.ema_decay, schedule.global_batch, cfg.ema_steps, cfg.epochs)
        return WeightAverage(unwrap(self.model), decay, cfg.ema_steps, schedule.warmup_steps)

    def build_micro_batches(self) -> MicroBatches:
        return MicroBatches(
            self.cfg, self.ctx, self.model, self.forward_model, self.loss_fn, self.optimizer,
            self.scaler, lambda: autocast_context(self.cfg, self.ctx),
        )  # fmt: skip

    def progress_now(self) -> dict[str, int]:
        """Where the loop is, as a user counts: epoch and optimizer step from 1."""
        return {"epoch": self.state.epoch + 1, "step": self.state.step + 1}

    # --- the run
    def fit(self) -> RunSummary:
        """The run trained: its last epoch's row, with the step breakdown of a finished run
        or where a preempted one stopped. Ctrl-C raises Interrupted with where it was."""
        self.start()
        last = self.state.history[-1] if self.state.history else {}
        if not self.work_left():
            return RunSummary(last_epoch=last)
        if self.ctx.is_main:  # each epoch once, even if the interrupted run wrote one more
            write_metrics_history(self.out / "metrics.jsonl", self.state.history)
        record.follow_progress(self.progress_now)  # where the loop was, in a flight record
        self.steplog.start(self.state.step)  # first: the trackers start from its rows
        self.steplog.attach(self.start_trackers())
        self.announce()
        total_steps = self.schedule.total_steps
        self.profiler = step_profiler(self.cfg, self.ctx, self.state.step, total_steps)
        profiling = self.profiler or contextlib.nullcontext()
        progress = ui.TrainProgress(self.ctx.is_main, self.cfg.epochs, self.data.steps_per_epoch())
        try:
            with progress, self.steplog, self.preemption, profiling:
                last = self.run_epochs(progress, last)
        except KeyboardInterrupt:  # Ctrl-C: rank 0's launcher says where, once
            self.trackers.stop("stopped")
            raise Interrupted(self.stop_record("interrupted")) from None
        except BaseException:
            self.trackers.stop("failed")
            raise
        if self.preemption.agreed and self.state.epoch < self.cfg.epochs:
            return RunSummary(last_epoch=last, stop=self.stop_record("preempted"))
        return RunSummary(last_epoch=last, step_breakdown=self.breakdown or None)

    def start(self) -> None:
        """Where the run starts: a checkpoint (--resume), --init-from's weights, or fresh."""
        path = self.checkpoints.agreed_resume_path()
        if path:  # the resumed weights replace any --init-from ones
            self.state, saved_batch = self.checkpoints.load(path)
            self.schedule.follow_resume(self.scheduler, self.state, saved_batch)
            self.finite_step = self.state.step
            if self.micro is not None:
                self.micro.resume(self.state.micro_batch, self.state.micro_batch_on)
            return
        if self.cfg.resume == "auto" and self.ctx.is_main:
            ui.info("--resume auto: no checkpoints/last.pt in the output folder; starting fresh")
        if self.cfg.init_from is not None:
            self.checkpoints.start_from_weights(self.cfg.init_from)

    # --- the experiment trackers (rank 0's): they follow steps.jsonl and metrics.jsonl
    def start_trackers(self) -> Trackers | None:
        """After the files are rewound to where the run starts: the trackers start (or
        continue the runs the checkpoint names) from what the files hold."""
        if not (self.ctx.is_main and self.cfg.trackers):
            return None
        self.trackers = Trackers(self.cfg.trackers, self.state.tracker_runs)
        self.trackers.start(run_opening(self.cfg, self.ctx, self.state.step))
        return self.trackers

    def checkpoint_saved(self, step: int) -> None:
        self.trackers.checkpoint_saved(step)

    def finish_trackers(self, summary: RunSummary) -> None:
        """After summary.json: the run's curves, summary and (--tracker-checkpoints) best.pt
        as artifacts, and each tracker's run ended."""
        if not self.trackers.couriers:
            return
        files = [self.out / SUMMARY_FILE]
        if self.trackers.append_only():  # the launcher draws it too, after the workers end
            from ddpcli.outputs.curves import CURVES_FILE, write_run_curves

            with contextlib.suppress(Exception):  # a picture is never worth a failed run
                write_run_curves(self.out)
            files.insert(0, self.out / CURVES_FILE)
        if self.cfg.tracker_checkpoints:
            files.append(self.out / "checkpoints" / "best.pt")
        self.trackers.finish(files, "stopped" if summary.stop is not None else "finished")

    def announce(self) -> None:
        announce_run(self.cfg, self.ctx, self.schedule, self.data, self.model, self.ema)

    def run_epochs(self, progress: ui.TrainProgress, last: dict[str, Any]) -> dict[str, Any]:
        while self.work_goes_on():
            last = self.run_epoch(progress)
            if self.state.batch_in_epoch < self.schedule.epoch_micro_batches(self.state):
                self.stop_inside_epoch(last)
            else:
                self.finish_epoch(last)
        return last

    def work_goes_on(self) -> bool:
        state = self.state
        if state.epoch >= self.cfg.epochs or self.schedule.reached_max_steps(state):
            return False
        return not self.preemption.stop_now(state.step, self.ctx, boundary=True)

    def work_left(self) -> bool:
        """False, said on rank 0, when a resume finds the work done: not a silent exit 0,
        and its outputs (metrics.jsonl too) stay as they are."""
        state, cfg = self.state, self.cfg
        if state.epoch >= cfg.epochs:
            reason = f"all {cfg.epochs} epochs are done; raise --epochs to train more"
        elif self.schedule.reached_max_steps(state):
            reason = (
                f"--max-steps {cfg.max_steps} is reached (step {state.step}, inside epoch "
                f"{state.epoch + 1}); raise or drop --max-steps to go on"
            )
        else:
            return True
        if self.ctx.is_main:
            ui.warn(f"nothing to train: {reason}")
        return False

    def stop_record(self, reason: str, preempt_signal: str | None = None) -> StopRecord:
        state = self.state
        return stop_record(
            reason,
            state.epoch + 1,
            state.step,
            self.checkpoints.saved_step,
            self.schedule.steps_per_epoch,
            self.out,
            preempt_signal,
        )

    def record_termination(self) -> None:
        """A SIGTERM that is not the preemption signal ends every rank now, unsaved: rank 0
        leaves where the run stopped, for the launcher's one line."""
        if not self.ctx.is_main:
            return
        record = self.stop_record("terminated", self.preemption.signal_name)
        write_text_atomic(self.out / SUMMARY_FILE, ui.json_text(record.to_dict()) + "\n")

    # --- an epoch
    def run_epoch(self, progress: ui.TrainProgress) -> dict[str, Any]:
        ctx, state = self.ctx, self.state
        self.model.train()
        sums = self.epoch_sums()
        self.steplog.start_epoch(state.partial_sums)
        self.clock.start_epoch()
        steps_before = state.step
        state.partial_sums = None
        batches = self.data.train_batches(
            state.epoch, skip_batches=state.batch_in_epoch, start=state.epoch_start
        )
        if self.micro is not None and not self.micro.announced:
            batches = self.settle_micro_batch(batches)
        timer = StepTimer(ctx.device, self.schedule.micro_batches_to_run(state))
        progress.start_epoch(state.epoch, state.batch_in_epoch)
        first_step_at = self.train_epoch(batches, sums, timer, progress)
        totals = self.reduce_sums(sums)
        stopped_inside = state.batch_in_epoch < self.schedule.epoch_micro_batches(state)
        if stopped_inside:  # what a resume adds to
            state.partial_sums = totals[:METRIC_SLOTS]
        metrics = self.epoch_metrics(totals, timer, state.step - steps_before, stopped_inside)
        return {**metrics, **({"first_step_at": first_step_at} if first_step_at else {})}

    def settle_micro_batch(self, batches: Any) -> Iterator[Any]:
        """--per-gpu-batch auto, before the first step: the micro-batch a resume kept, or one
        searched on the epoch's first batch (mixed as its step will mix it), which its step
        then trains on; stated once."""
        assert self.micro is not None
        iterator = iter(batches)
        if self.micro.size is None:
            first = next(iterator, None)
            if first is None:
                return iterator
            images, labels = first
            _, targets = self.mixed(images, labels, self.state.batch_in_epoch + 1)
            self.micro.search(images, targets, self.state.step)
            iterator = itertools.chain([first], iterator)
        self.state.micro_batch, self.state.micro_batch_on = self.micro.size, self.micro.devices
        if self.ctx.is_main:
            ui.info(self.micro.header_line(self.schedule.global_batch))
        self.micro.announced = True
        return iterator

    def epoch_sums(self) -> torch.Tensor:
        """Loss, correct, count; then each rank's [data wait, compute] seconds (rankload).
        Rank 0 carries the sums of the part of the epoch a checkpoint saved."""
        ctx, partial_sums = self.ctx, self.state.partial_sums
        sums = torch.zeros(slots_for(ctx.world_size), device=ctx.device, dtype=torch.float64)
        if partial_sums and ctx.is_main:
            partial = torch.tensor(partial_sums, device=ctx.device, dtype=torch.float64)
            sums[:METRIC_SLOTS] += partial
        return sums

    def train_epoch(
        self, batches: Any, sums: torch.Tensor, timer: StepTimer, progress: ui.TrainProgress
    ) -> float | None:
        """The epoch's micro-batches, to its end or to a stop inside it (--max-steps, a
        preemption). Returns when the run's first step ended, if it ended in this epoch."""
        cfg, ctx, state = self.cfg, self.ctx, self.state
        micro_total = self.schedule.epoch_micro_batches(state)
        first_step_at = None
        for images, labels in self.clock.waited(batches):
            state.batch_in_epoch += 1
            last_micro = state.batch_in_epoch == micro_total
            steps_now = state.batch_in_epoch % cfg.accumulate == 0 or last_micro
            accumulated = self.schedule.micro_batches_in_step(state, state.batch_in_epoch)
            mixed_images, targets = self.mixed(images, labels, state.batch_in_epoch)
            if self.micro is not None:
                self.train_share(mixed_images, labels, sums, targets)
            else:
                self.train_micro_step(mixed_images, labels, sums, steps_now, accumulated, targets)
            if timer.tick(len(labels)):  # the breakdown times what images/s times
                self.clock.start_epoch()
            if not steps_now:
                continue
            state.step += 1
            if self.ema is not None:
                self.ema.after_step(unwrap(self.model), state.step)
            if self.first_step_pending:  # one device sync per run, for "time to first step"
                first_step_at, self.first_step_pending = synced_time(ctx.device), False
            self.after_optimizer_step(sums, progress, timer, last_micro)
            if self.profiler is not None:
                self.profiler.at_step(state.step)
            if self.schedule.reached_max_steps(state) or self.preemption.stop_now(state.step, ctx):
                break
        return first_step_at

    def epoch_metrics(
        self, totals: list[float], timer: StepTimer, steps: int, stopped_inside: bool
    ) -> dict[str, Any]:
        """The epoch's row of metrics.jsonl, reduced over every rank."""
        cfg, ctx, state = self.cfg, self.ctx, self.state
        wait_s, compute_s = rank_seconds(totals[METRIC_SLOTS:])
        ranks = rank_figures(wait_s, compute_s, self.clock.epoch_seconds(), self.clock.steps)
        self.breakdown = step_breakdown(totals[METRIC_SLOTS:], self.clock.steps)
        train_loss, train_acc = means(totals)
        images_per_sec = timer.images_per_sec(ctx)
        if self.preemption.agreed and stopped_inside:  # a scheduler's grace is short: save
            validated = NOT_VALIDATED  # first, and the resume validates
        else:
            validated = self.validation.epoch_metrics(unwrap(self.model), self.ema)
        return {
            "epoch": state.epoch + 1,
            "step": state.step,
            "train_loss": train_loss,
            "train_acc": train_acc,
            **validated,
            "images_per_sec": images_per_sec,
            "lr": self.scheduler.get_last_lr()[0],
            "peak_lr": cfg.peak_lr,
            "global_batch": self.schedule.global_batch,
            "world_size": ctx.world_size,
            "data_path": self.data.path_name,
            **self.data.decode_figures(),
            **ranks,
            **memory_metrics(self.model, ctx),
        }

    # --- a step
    def mixed(
        self, images: torch.Tensor, labels: torch.Tensor, batch_in_epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With Mixup/CutMix: the mixed batch and its soft targets, drawn from (seed, epoch,
        micro-batch BATCH_IN_EPOCH, rank) alone; else the batch and its labels."""
        if self.mixing is None:
            return images, labels
        key = batch_in_epoch * self.ctx.world_size + self.ctx.rank
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
                self.fake_oom.check("forward", len(labels), self.state.step)
                if self.graphs:
                    step_begins()
                # Under graphs the logits are a replay's output: read before the next call.
                logits = self.forward_model(images)
                loss = self.loss_fn(logits, targets)
            self.fake_oom.check("backward", len(labels), self.state.step)
            self.scaler.scale(loss / accumulated).backward()
        self.clock.backward_done()
        with torch.no_grad():
            sums[0] += loss.detach().double() * len(labels)
            sums[1] += (logits.argmax(1) == labels).sum()
            sums[2] += len(labels)
        if steps_now:
            self.fake_oom.check("step", len(labels), self.state.step)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=not self.graphs)  # graphs keep .grad buffers
            self.scheduler.step()
        self.clock.compute_done(steps_now)

    def train_share(
        self, images: torch.Tensor, labels: torch.Tensor, sums: torch.Tensor, targets: torch.Tensor
    ) -> None:
        """--per-gpu-batch auto: one optimizer step on this rank's share of the global batch,
        in micro-batches (ddpcli.training.microbatch)."""
        assert self.micro is not None
        self.clock.compute_started()
        self.micro.train_step(images, labels, targets, sums, self.state.step)
        self.state.micro_batch = self.micro.size  # lowered, the checkpoints keep it
        self.clock.backward_done()
        self.scheduler.step()
        self.clock.compute_done(True)

    def after_optimizer_step(
        self,
        sums: torch.Tensor,
        progress: ui.TrainProgress,
        timer: StepTimer,
        last_micro: bool,
    ) -> None:
        state, cfg = self.state, self.cfg
        stops = self.schedule.reached_max_steps(state)
        logs_now = state.step % cfg.log_every == 0 or last_micro
        # At the epoch's end, or at --max-steps, the run saves anyway.
        every = cfg.save_every_steps
        saves_now = bool(every) and state.step % (every or 1) == 0 and not (last_micro or stops)
        # steps.jsonl also gets a row where a resume may start (a save, --max-steps), so
        # that its rows cover every step once, however often the run is resumed.
        if not (logs_now or saves_now or stops):
            return
        totals = self.reduce_sums(sums)
        self.log_step(totals)
        if logs_now:
            rate = timer.running_rate(self.ctx)
            progress.update(state.batch_in_epoch, *means(totals), rate, self.steplog.last_row)
        if saves_now:
            state.partial_sums = totals[:METRIC_SLOTS]
            self.check_weights()
            self.checkpoints.save(state, f"step-{state.step:08d}.pt", is_best=False)
            state.partial_sums = None

    def log_step(self, totals: list[float]) -> None:
        state = self.state
        position = {
            "step": state.step,
            "epoch": state.epoch + 1,
            "epoch_fraction": self.schedule.epoch_fraction(state),
        }
        self.steplog.record(position, totals, float(self.scheduler.get_last_lr()[0]))

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
        state, cfg, saved_step = self.state, self.cfg, self.checkpoints.saved_step
        when = f"at step {state.step}"
        if self.finite_step < state.step - 1:  # seen at a logging interval, not at once
            when = f"between step {self.finite_step} and step {state.step}"
        micro_batches = self.schedule.epoch_micro_batches(state)
        where = f"epoch {state.epoch + 1}, batch {state.batch_in_epoch} of {micro_batches}"
        if saved_step is None:
            kept = "no checkpoint had been saved yet"
        else:
            kept = f"checkpoints/last.pt and best.pt are kept as they were (step {saved_step})"
        hint = f"a lower --lr (this run: {cfg.lr:g})"
        if cfg.precision in ("fp16", "bf16"):
            hint += f" or full precision (--precision fp32; this run: {cfg.precision})"
        return agreed_error(
            f"{finding} {when} ({where}): training stopped; {kept}. Start again with {hint}"
        )

    # --- an epoch's end, or a stop inside it
    def finish_epoch(self, metrics: dict[str, Any]) -> None:
        self.check_weights()
        state = self.state
        state.history.append(metrics)
        is_best = self.record_best(metrics)
        state.epoch += 1
        state.batch_in_epoch = state.epoch_start = 0
        if self.ctx.is_main:
            self.append_metrics(metrics)
            self.steplog.epoch_end(metrics)
            ui.epoch_line(metrics, self.cfg.epochs)
            if note := straggler_note(metrics):
                ui.warn(f"epoch {metrics['epoch']}: {note}")
        self.checkpoints.save(state, f"epoch-{state.epoch:04d}.pt", is_best=is_best)
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
            self.append_metrics(metrics)
            self.steplog.epoch_end(metrics)
            ui.info(self.stop_line(metrics))
        self.checkpoints.save(state, f"step-{state.step:08d}.pt", is_best=is_best)
        state.partial_sums = None

    def stop_line(self, metrics: dict[str, Any]) -> str:
        cfg, state = self.cfg, self.state
        preempted = self.preemption.agreed
        how = self.preemption.signal_name if preempted else f"--max-steps {cfg.max_steps}"
        micro_batches = self.schedule.epoch_micro_batches(state)
        return (
            f"epoch {metrics['epoch']}/{cfg.epochs}, stopped by {how} after batch "
            f"{state.batch_in_epoch} of {micro_batches} · {ui.format_metrics(metrics)}"
            + ("" if preempted else f"; --out {self.out} --resume auto with --max-steps "
               "raised or dropped finishes it")
        )  # fmt: skip

    def append_metrics(self, metrics: dict[str, Any]) -> None:
        with open(self.out / "metrics.jsonl", "a") as handle:
            handle.write(ui.json_text(metrics) + "\n")
