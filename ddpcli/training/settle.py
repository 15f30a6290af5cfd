"""What a rank settles once it knows its world, its device and its data, in one place:
`settle_rank(...) -> RunPlan`, called once by each rank before it trains (after the ranks
agreed whether this round resumes, `agreed_resume`), and read from there on.

The launcher's plan (ddpcli.launcher.plan) knows the world it meant to start; the rank knows
the world that formed (torchrun's may be another), the device it was given, whether this is
a later round of the job (which continues from the last checkpoint), and how many
micro-batches its epoch has. From those: the accumulation that keeps the global batch across
a world change, the backend, `--precision auto` on a GPU (from its compute capability and
the size of the step), and the peak learning rate at the global batch of the steps really
taken.
"""

from __future__ import annotations

from typing import Any

import torch

from ddpcli import ui
from ddpcli.checkpoint.loading import safe_load
from ddpcli.checkpoint.schema import resume_path
from ddpcli.config.plan import RunPlan
from ddpcli.config.train import (
    CUDA_GRAPH_MODES,
    accumulate_keeping,
    global_batch_of,
    scaled_lr,
)
from ddpcli.dist import DistContext, all_reduce_max
from ddpcli.environments import LauncherEnv
from ddpcli.training.precision import (
    auto_cpu_precision,
    auto_gpu_precision,
    gpu_capability,
    native_cpu_bf16,
    training_gflop_per_step,
)


def settle_rank(plan: RunPlan, ctx: DistContext, resume: str | None, micro_batches: int) -> RunPlan:
    """PLAN as this rank runs it: RESUME as the ranks agreed it (`agreed_resume`), and
    MICRO_BATCHES per epoch as its data deals them."""
    accumulate, requested_accumulate = batch_policy(plan, resume, ctx.world_size)
    precision, precision_reason = device_precision(plan, ctx)
    # An epoch shorter than --accumulate makes smaller steps: the rate follows them.
    global_batch = global_batch_of(plan.per_gpu_batch, ctx.world_size, accumulate, micro_batches)
    settled: dict[str, Any] = {
        "resume": resume,
        "overwrite": plan.overwrite and resume != "auto",  # a later round never clears the run
        "backend": ctx.backend,
        "accumulate": accumulate,
        "requested_accumulate": requested_accumulate,
        "precision": precision,
        "precision_reason": precision_reason,
        "peak_lr": scaled_lr(plan.lr, global_batch, plan.lr_base_batch, plan.lr_scaling),
    }
    return RunPlan.model_validate({**dict(plan), **settled})


def agreed_resume(
    plan: RunPlan, env: LauncherEnv, ctx: DistContext, later_round: bool
) -> str | None:
    """--resume as this round of the job runs it. LATER_ROUND: the agent started this worker
    again (after a failure, or because hosts joined or left an elastic job), which continues
    from the last checkpoint, as --resume auto. Agreed (a collective): the workers of a host
    that has just joined start their agent's first round."""
    if plan.resume is not None:
        return plan.resume
    mine = float(env.restart_count > 0 or later_round)
    if not all_reduce_max(torch.tensor([mine], device=ctx.device), ctx).item():
        return None
    if env.rank == 0:
        why = f"restart {env.restart_count}" if env.restart_count else "a new round of the job"
        ui.warn(f"{why}: resuming from the last checkpoint")
    return "auto"


def batch_policy(plan: RunPlan, resume: str | None, world_size: int) -> tuple[int, int | None]:
    """(accumulate, the command's own --accumulate when the policy changed it). A resume at
    another world keeps the checkpoint's global batch by accumulating when the new world
    divides it, with the per-process batch and the command's --accumulate as they were;
    otherwise the accumulation stays and the peak rate follows the new global batch by the
    lr-scaling rule. A new --per-gpu-batch or --accumulate is taken as given. The
    checkpoint's world may be this one: a restart after the policy raised --accumulate keeps
    it. Structure only (memory-mapped): a file that cannot be resumed is refused, with its
    reason, when the trainer loads it."""
    path = resume_path(resume, plan.out)
    if path is None or not path.is_file():
        return plan.accumulate, plan.requested_accumulate
    payload = safe_load(path, lazy=True)
    if not isinstance(payload, dict) or not isinstance(payload.get("config"), dict):
        return plan.accumulate, plan.requested_accumulate
    if not isinstance(payload.get("world_size"), int):
        return plan.accumulate, plan.requested_accumulate
    return accumulation_after(plan, payload["config"], payload["world_size"], world_size)


def accumulation_after(
    plan: RunPlan, saved: dict[str, Any], saved_world: int, world_size: int
) -> tuple[int, int | None]:
    """`batch_policy` for a checkpoint's SAVED config, written at SAVED_WORLD ranks."""
    kept = plan.accumulate, plan.requested_accumulate
    requested = int(saved.get("requested_accumulate") or saved.get("accumulate", 1))
    if saved.get("per_gpu_batch") != plan.per_gpu_batch or plan.accumulate != requested:
        return kept
    saved_global = plan.per_gpu_batch * saved_world * int(saved.get("accumulate", 1))
    if saved_global == plan.per_gpu_batch * world_size * plan.accumulate:
        return kept
    accumulate = accumulate_keeping(saved_global, plan.per_gpu_batch, world_size)
    return kept if accumulate is None else (accumulate, requested)


def device_precision(plan: RunPlan, ctx: DistContext) -> tuple[str, str | None]:
    """`--precision auto` on a GPU, decided from the device this rank was given (on the CPU
    the launcher decided it, unless it took this machine for a GPU one)."""
    if plan.precision != "auto":
        return plan.precision, plan.precision_reason
    if ctx.device.type == "cuda":
        step_gflop = training_gflop_per_step(
            plan.arch, plan.train_crop_size, plan.per_gpu_batch, plan.model_args
        )
        cuda_graphs = plan.compile and plan.compile_mode in CUDA_GRAPH_MODES
        return auto_gpu_precision(gpu_capability(ctx.device), step_gflop, cuda_graphs)
    return auto_cpu_precision(plan.arch, native_cpu_bf16())
