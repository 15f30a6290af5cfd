"""The training checkpoint's schema, in one place: what a save holds, how it is built from
the run's parts, how a resume restores them, and what makes a file resumable.

Everything stored is tensors and plain types (RNG states included), so every file we write
loads with `weights_only=True`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddpcli import ui
from ddpcli.checkpoint.loading import (
    check_recorded_digest,
    file_stamp,
    iter_tensors,
    listed_briefly,
    load_model_state,
    model_state,
    non_finite_tensors,
    safe_load,
    unchecked_digest_reason,
)
from ddpcli.config import TrainConfig
from ddpcli.config.common import CHANGES_RESULT, settings_of_kind
from ddpcli.config.plan import RunPlan
from ddpcli.data.resharding import samples_trained
from ddpcli.dist import DistContext
from ddpcli.errors import usage_error

FORMAT = "ddpcli-checkpoint-v1"
# What `--resume` needs; a weights-only file or a plain state dict lacks some of it.
TRAINING_KEYS = (
    "model", "optimizer", "scheduler", "epoch", "batch_in_epoch", "step", "metrics", "config",
    "rng", "world_size",
)  # fmt: skip
# Settings that change the arithmetic (marked so on TrainConfig's fields): resuming with
# other values cannot reproduce the run. Not --max-steps: it only says where a run stops,
# and a resume may raise or drop it.
RESULT_SETTINGS = settings_of_kind(TrainConfig, CHANGES_RESULT)


@dataclass
class TrainState:
    """What a checkpoint restores besides the weights: where we are and what we saw."""

    epoch: int = 0  # the epoch being (or about to be) trained, 0-based
    batch_in_epoch: int = 0  # micro-batches of `epoch` already trained at this world
    # The global sample offset this world's share of `epoch` was dealt from: 0, unless a
    # resume at another world re-dealt the rest of the epoch (ddpcli.data.resharding).
    epoch_start: int = 0
    step: int = 0  # optimizer steps taken
    best_val_acc: float = -1.0
    history: list[dict[str, Any]] = field(default_factory=list)
    partial_sums: list[float] | None = None  # global [loss_sum, correct, count] mid-epoch
    # --dataset shards, inside an epoch: the streams' pieces not yet trained and the epoch's
    # plan (ddpcli.data.shards.plan), plain data; None elsewhere.
    stream_position: dict[str, Any] | None = None
    # Each experiment tracker's run id (`--tracker mlflow`: its MLflow run), set on rank 0:
    # every resume continues those runs.
    tracker_runs: dict[str, str] = field(default_factory=dict)
    # --per-gpu-batch auto: the micro-batch the run steps with, and the devices it was found
    # on ("3 x cpu", "8 x NVIDIA H200"): a resume on the same ones keeps it, any other
    # searches again (ddpcli.training.microbatch).
    micro_batch: int | None = None
    micro_batch_on: str | None = None


@dataclass
class TrainingParts:
    """The objects a checkpoint saves and a resume restores, besides the TrainState."""

    model: torch.nn.Module  # unwrapped: keys without DDP's `module.` prefix
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    # ddpcli.training.ema.WeightAverage with --ema: its averaged weights are saved too.
    ema: Any = None
    # ddpcli.training.compression.PowerSGD with --grad-compression powersgd: each rank's
    # error feedback, Q memory and step count are saved too, by rank.
    compression: Any = None


def training_payload(
    parts: TrainingParts,
    state: TrainState,
    cfg: RunPlan,
    ctx: DistContext,
    num_classes: int,
    classes: list[str] | None = None,
    normalization: dict[str, list[float]] | None = None,
) -> dict[str, Any]:
    """Everything a resume needs, and what evaluation and export rebuild the model's view
    from: CLASSES, the label order's names, and NORMALIZATION, the `mean` and `std` its
    inputs were normalised with. Collective: every rank must call it (RNG states)."""
    return {
        "format": FORMAT,
        "model": parts.model.state_dict(),
        "optimizer": parts.optimizer.state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict() if parts.scaler.is_enabled() else None,
        "ema": parts.ema.state_dict() if parts.ema is not None else None,
        "grad_compression": (
            parts.compression.checkpoint_state(ctx) if parts.compression is not None else None
        ),
        "epoch": state.epoch,
        "batch_in_epoch": state.batch_in_epoch,
        "epoch_start": state.epoch_start,
        # Any world continues the epoch from here: the order's first this-many samples are done.
        "sample_offset": samples_trained(
            state.epoch_start, state.batch_in_epoch, cfg.per_gpu_batch, ctx.world_size
        ),
        "step": state.step,
        "best_val_acc": state.best_val_acc,
        "metrics": state.history,
        "partial_sums": state.partial_sums,
        "stream_position": state.stream_position,
        "tracker_runs": dict(state.tracker_runs),
        "micro_batch": state.micro_batch,
        "micro_batch_on": state.micro_batch_on,
        "world_size": ctx.world_size,
        "num_classes": num_classes,
        "classes": list(classes) if classes is not None else None,
        "normalization": normalization,
        "config": json.loads(cfg.model_dump_json()),
        "rng": gather_rng_states(ctx, capture_rng_state()),
    }


def restore_training(
    payload: dict[str, Any], parts: TrainingParts, ctx: DistContext, path: Path, per_gpu_batch: int
) -> TrainState:
    """Load a training checkpoint into the run's parts; this rank's RNG state too when the
    world has the size that saved it. The position in the epoch is this world's own
    (`resumed_position`)."""
    load_model_state(parts.model, payload["model"], path)
    check_optimizer_fits(payload, parts.optimizer, path)
    parts.optimizer.load_state_dict(payload["optimizer"])
    parts.scheduler.load_state_dict(payload["scheduler"])
    if payload.get("scaler"):
        parts.scaler.load_state_dict(payload["scaler"])
    if parts.ema is not None:
        parts.ema.load_state_dict(payload.get("ema"), parts.model)
    if payload["world_size"] == ctx.world_size:
        restore_rng_state(payload["rng"][ctx.rank])
    if parts.compression is not None:
        note = parts.compression.resume(payload.get("grad_compression"), payload["step"], ctx)
        if note and ctx.is_main:
            ui.info(note)
    epoch_start, batch_in_epoch = resumed_position(payload, ctx.world_size, per_gpu_batch)
    return TrainState(
        epoch=payload["epoch"],
        batch_in_epoch=batch_in_epoch,
        epoch_start=epoch_start,
        step=payload["step"],
        best_val_acc=payload["best_val_acc"],
        history=list(payload["metrics"]),
        partial_sums=payload.get("partial_sums"),
        stream_position=payload.get("stream_position"),
        tracker_runs=dict(payload.get("tracker_runs") or {}),
        micro_batch=payload.get("micro_batch"),
        micro_batch_on=payload.get("micro_batch_on"),
    )


def sample_offset(payload: dict[str, Any]) -> int:
    """The interrupted epoch's samples trained, as a global offset into its order; derived
    from the micro-batches, the batch and the world for files written before it was kept."""
    if "sample_offset" in payload:
        return int(payload["sample_offset"])
    per_gpu_batch = int(payload["config"]["per_gpu_batch"])
    return samples_trained(0, payload["batch_in_epoch"], per_gpu_batch, payload["world_size"])


def resumed_position(
    payload: dict[str, Any], world_size: int, per_gpu_batch: int
) -> tuple[int, int]:
    """(epoch_start, batch_in_epoch) for the resumed run. The world and batch that saved the
    file skip the batches it trained (an exact resume, bit for bit); any other world is
    dealt the rest of the epoch from its global sample offset. Shards are always dealt
    again, from their stream position (its pieces; the offset only counts them)."""
    if payload.get("stream_position"):
        return sample_offset(payload), 0
    saved_batch = int(payload["config"]["per_gpu_batch"])
    if payload["world_size"] == world_size and saved_batch == per_gpu_batch:
        return int(payload.get("epoch_start", 0)), int(payload["batch_in_epoch"])
    return sample_offset(payload), 0


def weights_only_payload(payload: dict[str, Any], state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Our checkpoint without optimizer, scheduler and RNG state (`checkpoint convert`)."""
    kept = (
        "format", "epoch", "step", "best_val_acc", "metrics", "config", "num_classes", "classes",
        "normalization",
    )  # fmt: skip
    document = {key: payload[key] for key in kept if key in payload}
    document.update(model=state, weights_only=True, world_size=payload.get("world_size"))
    return document


def checkpoint_kind(payload: Any) -> str:
    if isinstance(payload, dict) and payload.get("format") == FORMAT:
        return "weights-only" if payload.get("weights_only") else "training"
    return "state-dict" if model_state(payload) is not None else "unknown"


def load_training_checkpoint(
    path: Path, map_location: Any, checked_stamp: str | None = None
) -> dict[str, Any]:
    """A checkpoint `--resume` can continue from: safe, uncorrupted, and complete. Its bytes
    are hashed unless CHECKED_STAMP says the launcher hashed this very file
    (`ddpcli.launcher.plan`): reading a large file once more is seconds per rank."""
    unchanged = checked_stamp is not None and file_stamp(path) == checked_stamp
    payload = safe_load(path, map_location=map_location, check_digest=not unchanged)
    check_training_payload(payload, path)
    return payload


def check_training_payload(payload: Any, path: Path) -> None:
    if isinstance(payload, dict) and payload.get("weights_only"):
        raise usage_error(
            f"cannot resume from {path}: it holds weights only (no optimizer, scheduler or RNG "
            "state); resume from a full checkpoint such as OUT/checkpoints/last.pt"
        )
    missing = [key for key in TRAINING_KEYS if not isinstance(payload, dict) or key not in payload]
    if missing:
        raise usage_error(
            f"cannot resume from {path}: it is not a ddpcli training checkpoint "
            f"(no {', '.join(missing[:3])}); `ddpcli checkpoint inspect` shows what it holds"
        )


def resume_warnings(payload: dict[str, Any], config: dict[str, Any], world_size: int) -> list[str]:
    """What makes the resumed run differ from the uninterrupted one, besides a change of
    world (`world_change_line` states that). CONFIG is this run's resolved config (with its
    `peak_lr`), WORLD_SIZE the world it really has."""
    notes = []
    saved = payload.get("config") or {}
    world_changed = payload["world_size"] != world_size
    rate_note = rate_change(saved, payload["world_size"], config, world_size)
    if rate_note and not world_changed:
        notes.append(rate_note + ": training continues at the new rate on the restored schedule")
    # A new world's accumulation is the batch policy's, stated in the world's line.
    compared = [key for key in RESULT_SETTINGS if not (world_changed and key == "accumulate")]
    changed = [
        f"{key} {saved[key]!r} -> {config.get(key)!r}"
        for key in compared
        if key in saved and saved[key] != config.get(key)
    ]
    if changed:
        notes.append(
            f"settings differ from the checkpoint's ({', '.join(changed)}): the result will not "
            "match an uninterrupted run"
        )
    return notes


def world_change_line(payload: dict[str, Any], config: dict[str, Any], world_size: int) -> str:
    """`world 3 -> 2: global batch 48 -> 32 (per-process batch 16 kept; 48 is not a multiple
    of 2 x 16), accumulate 1 -> 1, peak lr 0.01875 -> 0.0125 (...)`; "" if the world is
    the one that saved the file."""
    saved, saved_world = payload.get("config") or {}, payload["world_size"]
    if saved_world == world_size:
        return ""
    old_batch, new_batch = global_batch_of(saved, saved_world), global_batch_of(config, world_size)
    per_gpu_batch = config.get("per_gpu_batch")
    if saved.get("per_gpu_batch") != per_gpu_batch:
        why = f"--per-gpu-batch {saved.get('per_gpu_batch')} -> {per_gpu_batch} as given"
    elif old_batch == new_batch:
        why = "kept"
    else:
        why = (
            f"per-process batch {per_gpu_batch} kept; {old_batch} is not a multiple of "
            f"{world_size} x {per_gpu_batch}"
        )
    old_rate = saved.get("peak_lr", saved.get("lr"))  # before lr scaling, lr was used as given
    return (
        f"world {saved_world} -> {world_size}: global batch {old_batch} -> {new_batch} ({why}), "
        f"accumulate {saved.get('accumulate', 1)} -> {config.get('accumulate')}, peak lr "
        f"{shown_rate(old_rate)} -> {shown_rate(config.get('peak_lr'))} ({lr_rule(config)})"
    )


def rate_change(
    saved: dict[str, Any], saved_world: int, config: dict[str, Any], world_size: int
) -> str | None:
    """`global batch 64 -> 128, peak lr 0.025 -> 0.05 (...)` when either changed."""
    old_batch = global_batch_of(saved, saved_world)
    new_batch = global_batch_of(config, world_size)
    old_rate = saved.get("peak_lr", saved.get("lr"))  # before lr scaling, lr was used as given
    new_rate = config.get("peak_lr")
    if old_batch == new_batch and old_rate == new_rate:
        return None
    return (
        f"global batch {old_batch} -> {new_batch}, peak lr {shown_rate(old_rate)} -> "
        f"{shown_rate(new_rate)} ({lr_rule(config)})"
    )


def lr_rule(config: dict[str, Any]) -> str:
    if config.get("lr_scaling") == "none":
        return "--lr-scaling none: lr as given"
    return (
        f"lr {config.get('lr')} per {config.get('lr_base_batch')} images, "
        f"{config.get('lr_scaling')} scaling"
    )


def global_batch_of(config: dict[str, Any], world_size: int) -> int | str:
    try:
        return int(config["per_gpu_batch"]) * world_size * int(config.get("accumulate", 1))
    except (KeyError, TypeError, ValueError):
        return "?"


def shown_rate(rate: Any) -> str:
    return f"{rate:g}" if isinstance(rate, (int, float)) else "?"


def check_resume_source(cfg: RunPlan) -> str | None:
    """For the launcher (and a dry run), before any worker starts: a missing, broken, unsafe
    or damaged `--resume` file is one line and exit 2 at once. What `checkpoint verify`
    checks is checked here (memory-mapped), and a digest that cannot be checked is said.
    The stamp of the file checked (None: no file to resume from)."""
    path = find_resume_path(cfg)
    if path is None:
        return None
    stamp = file_stamp(path)  # before any read: a file replaced meanwhile is hashed again
    payload = safe_load(path, lazy=True)
    check_training_payload(payload, path)
    check_same_arch(payload, cfg.arch, path)
    check_same_optimizer(payload, cfg.optimizer, path)
    if cfg.dataset == "shards" and cfg.data_dir is not None:
        from ddpcli.data.shards.checks import check_resumed_shards

        # A stream position saved inside an epoch is good for its own shards only.
        check_resumed_shards(payload.get("stream_position"), cfg.data_dir, path)
    unchecked = unchecked_digest_reason(path, check_recorded_digest(path))
    if unchecked:
        ui.warn(f"cannot check {path} against its save's SHA-256, resuming anyway: {unchecked}")
    check_finite_payload(payload, path)
    return stamp


def check_finite_payload(payload: dict[str, Any], path: Path) -> None:
    """NaN or inf anywhere (weights, a momentum buffer, the EMA) would resume into a run
    that cannot recover from it."""
    bad, _ = non_finite_tensors(iter_tensors(payload))
    if bad:
        raise usage_error(
            f"cannot resume from {path}: it holds NaN or inf ({listed_briefly(bad)}); resume "
            "from an earlier checkpoint (`ddpcli checkpoint verify` checks each)"
        )


def check_same_arch(payload: dict[str, Any], wanted: str | None, path: Path) -> None:
    """Another architecture's weights fail on every rank, after the launch, each rank listing
    shapes that do not fit and none naming the architecture that would: refuse them here,
    naming both (a `--resume auto` without the run's --arch gets the default one)."""
    saved = (payload.get("config") or {}).get("arch")
    if wanted is not None and isinstance(saved, str) and saved != wanted:
        raise usage_error(
            f"cannot resume from {path}: it was trained with --arch {saved}, this run asks for "
            f"--arch {wanted}; resume with --arch {saved}, or give another --out to start a "
            f"new {wanted} run"
        )


# The class of the optimizer each --optimizer value builds (ddpcli.training.parts.make_optimizer).
OPTIMIZER_FLAGS = {"SGD": "sgd", "AdamW": "adamw"}


def check_same_optimizer(payload: dict[str, Any], wanted: str, path: Path) -> None:
    """Another optimizer's state loads without a word and fails at the first step (torch's
    KeyError 'momentum_buffer' or 'step'): refuse it, naming both."""
    saved = (payload.get("config") or {}).get("optimizer") or "sgd"  # before adamw: sgd
    if saved != wanted:
        raise usage_error(
            f"cannot resume from {path}: it was trained with --optimizer {saved}, this run asks "
            f"for --optimizer {wanted}; resume with --optimizer {saved}, or start a new run from "
            f"its weights with --init-from {path}"
        )


def check_optimizer_fits(
    payload: dict[str, Any], optimizer: torch.optim.Optimizer, path: Path
) -> None:
    """The saved optimizer state is this optimizer's, with as many parameter groups."""
    kind = type(optimizer).__name__
    check_same_optimizer(payload, OPTIMIZER_FLAGS.get(kind, kind.lower()), path)
    saved_groups = len(payload["optimizer"].get("param_groups", []))
    if saved_groups != len(optimizer.param_groups):
        raise usage_error(
            f"cannot resume from {path}: its optimizer has {saved_groups} parameter group(s), "
            f"this run's has {len(optimizer.param_groups)} (--norm-weight-decay adds one for "
            "the norm layers); resume with the checkpoint's settings"
        )


def find_resume_path(cfg: RunPlan) -> Path | None:
    """The file `--resume` names: see `resume_path`."""
    return resume_path(cfg.resume, cfg.out)


def resume_path(resume: str | None, out: Path) -> Path | None:
    """`--resume auto` continues from OUT/checkpoints/last.pt when there is one; a folder
    given to `--resume` means its last.pt (or checkpoints/last.pt)."""
    if not resume:
        return None
    if resume == "auto":
        last = out / "checkpoints" / "last.pt"
        return last if last.is_file() else None
    path = Path(resume)
    if path.is_dir():
        for candidate in (path / "last.pt", path / "checkpoints" / "last.pt"):
            if candidate.is_file():
                return candidate
    return path


# --- Random number generator state as tensors and plain types ----------------------------


def capture_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=True)
    assert isinstance(numpy_state, tuple), "the global RandomState is MT19937: a legacy tuple"
    kind, keys, pos, has_gauss, cached = numpy_state
    state = {
        "python": [version, list(internal), gauss],
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    # A map_location onto a GPU moves these tensors there too; RNG states live on the CPU.
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].cpu().numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def gather_rng_states(ctx: DistContext, state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's RNG state, in rank order, so a resume restores each rank exactly."""
    if not ctx.distributed:
        return [state]
    states: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(states, state)
    return states
