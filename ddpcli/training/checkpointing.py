"""The trainer's checkpoints: what goes into one (the parts and the TrainState), where a run
resumes from (every rank agreeing), what a resume says, and --init-from's weights.

The payload's layout, its safe loading and the atomic writer live in ddpcli.checkpoint;
this is the loop's side of them, with `save` and `load` as its interface.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

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
from ddpcli.checkpoint.writer import CheckpointWriter
from ddpcli.config.plan import RunPlan
from ddpcli.data.pipeline import DataPath
from ddpcli.dist import DistContext, all_reduce_max
from ddpcli.errors import runtime_error


class Checkpointing:
    def __init__(
        self,
        cfg: RunPlan,
        ctx: DistContext,
        data: DataPath,
        parts: TrainingParts,
        on_saved: Callable[[int], None] | None = None,
    ) -> None:
        self.cfg, self.ctx, self.data, self.parts = cfg, ctx, data, parts
        self.writer = CheckpointWriter(cfg, ctx)
        self.saved_step: int | None = None  # the step of the newest checkpoint in --out
        self.on_saved = on_saved  # told each saved step (the trackers' rows up to it go)

    def save(self, state: TrainState, name: str, is_best: bool) -> None:
        """Callers check the weights first (Trainer.check_weights): last.pt must stay a good
        one."""
        splits = self.data.splits
        # A collective on shards: every rank's streams say what they have left.
        state.stream_position = self.data.state_dict(state.batch_in_epoch, state.epoch_start)
        normalization = {"mean": list(self.data.mean), "std": list(self.data.std)}
        payload = training_payload(
            self.parts, state, self.cfg, self.ctx, splits.num_classes, splits.class_names,
            normalization,
        )  # fmt: skip
        self.writer.save(payload, name, is_best=is_best)
        self.saved_step = state.step
        if self.on_saved is not None:
            self.on_saved(state.step)

    def load(self, path: Path) -> tuple[TrainState, int | str]:
        """The parts restored from PATH: the position they stand at, and the global batch
        the run that saved them trained with (its steps are the scheduler's count; "?" where
        the file does not say)."""
        payload = load_training_checkpoint(path, self.ctx.device, self.cfg.resume_checked)
        state = restore_training(payload, self.parts, self.ctx, path, self.cfg.per_gpu_batch)
        self.data.load_state_dict(state.stream_position)
        saved_batch = global_batch_of(payload.get("config") or {}, payload["world_size"])
        if path.resolve() == (self.writer.directory / "last.pt").resolve():
            self.saved_step = state.step
        if self.ctx.is_main:
            self.announce_resume(payload, path, state)
        return state, saved_batch

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

    def announce_resume(self, payload: dict[str, Any], path: Path, state: TrainState) -> None:
        """Rank 0: where the run goes on, what a new world changed, and how it deals the
        rest of the interrupted epoch."""
        world_size = self.ctx.world_size
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
            self.parts.model, path, num_classes, self.cfg.reset_head, self.ctx.device
        )
        if self.ctx.is_main:
            ui.info(report.line())
