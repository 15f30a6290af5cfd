"""One rank of `ddpcli eval`: join the group, rebuild the model from the checkpoint, run its
batches, and hand every image's outcome to rank 0, which computes the figures and writes
the eval folder."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ddpcli import ui
from ddpcli.checkpoint.loading import deployed_state, safe_load, strip_ddp_prefix
from ddpcli.config.eval import EvalConfig
from ddpcli.dist import DistContext, all_gather_object, init_distributed, shutdown
from ddpcli.environments import LauncherEnv
from ddpcli.errors import runtime_error
from ddpcli.evaluation.data import EvalImages, dealt_batches, load_images
from ddpcli.evaluation.metrics import TOP_K, Outcomes, summarize
from ddpcli.evaluation.outputs import write_eval_folder
from ddpcli.evaluation.plan import EvalPlan, safetensors_payload
from ddpcli.machine import cpu_count
from ddpcli.models.build import build_model
from ddpcli.training.precision import auto_cpu_precision, auto_gpu_precision, gpu_capability
from ddpcli.training.strategy import AUTOCAST_DTYPES

PROGRESS_MIN_BATCHES = 20  # fewer: done before a bar would say anything


def run_rank(cfg: EvalConfig, plan: EvalPlan, env: LauncherEnv) -> dict[str, Any] | None:
    """The report on rank 0, None elsewhere. The group is torn down after a clean run only:
    after an error the caller ends the process at once (a teardown could wait on peers)."""
    torch.set_num_threads(max(1, cpu_count() // max(1, env.local_world_size)))
    ctx = init_distributed(
        env,
        want_gpu=not cfg.cpu,
        backend=cfg.backend,
        init_method=cfg.init_method,
        timeout_s=cfg.timeout,
    )
    report = evaluate(plan, ctx)
    shutdown()
    return report


def evaluate(plan: EvalPlan, ctx: DistContext) -> dict[str, Any] | None:
    images = load_images(plan)
    dealt = dealt_batches(len(images), plan.per_gpu_batch, ctx.world_size, ctx.rank)
    model = rebuilt_model(plan, ctx.device)
    precision, precision_reason = resolved_precision(plan, ctx.device)
    configure_math(precision, ctx.device)
    started = time.perf_counter()
    batches = with_progress(images.batches(plan, ctx, dealt), len(dealt), ctx)
    mine = measure(model, batches, dealt, plan.num_classes, precision, ctx.device)
    parts = all_gather_object(mine, ctx)
    seconds = time.perf_counter() - started
    if not ctx.is_main:
        return None
    outcomes = Outcomes.joined(parts)
    check_every_image_once(outcomes, len(images))
    figures, matrix = summarize(outcomes, plan.classes)
    report = describe(plan, ctx, images, precision, precision_reason, seconds) | figures
    report["files"] = write_eval_folder(
        Path(plan.out), report, matrix, outcomes, images.names, plan.predictions
    )
    return report


def describe(
    plan: EvalPlan,
    ctx: DistContext,
    images: EvalImages,
    precision: str,
    precision_reason: str,
    seconds: float,
) -> dict[str, Any]:
    """What was measured, how, and at what speed: the report's header."""
    data = plan.dataset if plan.data_dir is None else f"{plan.dataset} {plan.data_dir}"
    return {
        "checkpoint": plan.checkpoint,
        "weights": plan.weights,
        "weights_reason": plan.weights_reason,
        "arch": plan.arch,
        "data": f"{data} ({plan.split})",
        "split": plan.split,
        "num_classes": plan.num_classes,
        "classes": plan.classes,
        "image_size": plan.image_size,
        "val_resize_size": plan.val_resize_size,
        "val_crop_size": plan.crop_size,
        "normalization": {"mean": images.mean, "std": images.std},
        "precision": precision,
        "precision_reason": precision_reason,
        "per_gpu_batch": plan.per_gpu_batch,
        "world_size": ctx.world_size,
        "device": ctx.device.type,
        "seconds": seconds,
        "images_per_sec": len(images) / seconds if seconds > 0 else None,
        "run": plan.run_figures,
        "out": plan.out,
    }


def rebuilt_model(plan: EvalPlan, device: torch.device) -> nn.Module:
    """The plan's architecture with the checkpoint's chosen weights, in eval mode."""
    state = chosen_state(plan)
    model = build_model(plan.arch, plan.num_classes, plan.model_args)
    model.load_state_dict(state)  # the launching process checked that they fit
    return model.to(device).eval()


def chosen_state(plan: EvalPlan) -> dict[str, torch.Tensor]:
    path = Path(plan.checkpoint)
    if path.suffix == ".safetensors":  # one set of weights: the plan names which
        return safetensors_payload(path)["model"]
    state, _ = deployed_state(safe_load(path), plan.weights)
    assert state is not None, "the launching process found the weights in the file"
    return strip_ddp_prefix(state)


def resolved_precision(plan: EvalPlan, device: torch.device) -> tuple[str, str]:
    """A run saved with `auto` unresolved (a file from before it was resolved in the
    workers): what `auto` means on this device, as training decides it."""
    if plan.precision != "auto":
        return plan.precision, plan.precision_reason
    if device.type == "cuda":
        return auto_gpu_precision(gpu_capability(device))
    from ddpcli.training.precision import native_cpu_bf16

    return auto_cpu_precision(plan.arch, native_cpu_bf16())


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    dtype = AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def configure_math(precision: str, device: torch.device) -> None:
    """fp32 on a GPU as training ran it there: TF32 in matmuls and convolutions. No cuDNN
    benchmark: the algorithm it times could differ from one run to the next, and so the
    last bits of a figure."""
    if device.type == "cuda" and precision == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


@torch.no_grad()
def measure(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    dealt: list[list[int]],
    num_classes: int,
    precision: str,
    device: torch.device,
) -> Outcomes:
    """This rank's outcomes (its DEALT batches): per image its label, top-k classes and
    their probabilities, and its loss."""
    k = min(TOP_K, num_classes)
    collected: dict[str, list[np.ndarray]] = {"labels": [], "top": [], "probs": [], "losses": []}
    for images, labels in batches:
        with autocast(precision, device):
            logits = model(images)
        logits = logits.float()
        losses = nn.functional.cross_entropy(logits, labels, reduction="none")
        probabilities = logits.softmax(dim=1)
        # A stable sort puts the lowest class first among equals, as argmax (training's
        # validation) does: a model that answers the same for every class is counted alike.
        top_classes = logits.sort(dim=1, descending=True, stable=True).indices[:, :k]
        top_probs = probabilities.gather(1, top_classes)
        collected["labels"].append(labels.cpu().numpy())
        collected["top"].append(top_classes.cpu().numpy())
        collected["probs"].append(top_probs.cpu().numpy())
        collected["losses"].append(losses.cpu().numpy())
    indices = np.array([index for batch in dealt for index in batch], dtype=np.int64)
    return Outcomes(
        indices,
        joined(collected["labels"], np.int64, (0,)),
        joined(collected["top"], np.int64, (0, k)),
        joined(collected["probs"], np.float32, (0, k)),
        joined(collected["losses"], np.float32, (0,)),
    )


def joined(arrays: list[np.ndarray], dtype: Any, empty: tuple[int, ...]) -> np.ndarray:
    """A rank dealt no batch (a world larger than the batches) has nothing to join."""
    return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(empty, dtype=dtype)


def check_every_image_once(outcomes: Outcomes, size: int) -> None:
    if not np.array_equal(outcomes.indices, np.arange(size)):
        raise runtime_error(
            f"evaluation counted {len(outcomes)} outcomes for {size} images: an image was "
            "missed or counted twice (a bug in ddpcli: please report it)"
        )


def with_progress(batches: Iterable[Any], total: int, ctx: DistContext) -> Iterator[Any]:
    """Rank 0's bar over its own batches (every rank has as many, give or take one), on a
    terminal and for runs long enough to need one; a line per quarter in a log."""
    if not ctx.is_main or total < PROGRESS_MIN_BATCHES:
        yield from batches
        return
    if ui.console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

        columns = (BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress("evaluating", *columns, console=ui.console, transient=True) as bar:
            task = bar.add_task("eval", total=total)
            for batch in batches:
                yield batch
                bar.advance(task)
        return
    quarter = math.ceil(total / 4)
    for done, batch in enumerate(batches, start=1):
        yield batch
        if done % quarter == 0 and done < total:
            ui.info(f"evaluating: {done} of {total} batches (rank 0)")
