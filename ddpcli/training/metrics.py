"""What an epoch measures besides validation: mean loss and accuracy from the reduced sums,
images per second (StepTimer), when the first step ended, and peak memory per rank."""

from __future__ import annotations

import resource
import time

import torch
from torch import nn

from ddpcli.dist import DistContext, all_reduce_max, all_reduce_sum
from ddpcli.timing import synced_clock, synchronize
from ddpcli.training.strategy import model_devices

TIMING_WARMUP_STEPS = 3  # the first steps pay for allocation and autotuning; not timed


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


def memory_metrics(model: nn.Module, ctx: DistContext) -> dict[str, list[float]]:
    """Peak memory so far: per GPU on CUDA (by rank with DDP, by GPU with dp), and the
    host's peak resident set per rank (what a CPU run uses)."""
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    metrics = {"peak_rss_mb": per_rank(rss_mb, ctx)}
    if ctx.device.type == "cuda":
        devices = model_devices(model, ctx)
        peaks = [torch.cuda.max_memory_allocated(device) / 2**20 for device in devices]
        metrics["peak_memory_mb"] = (
            [round(peak, 1) for peak in peaks] if len(peaks) > 1 else per_rank(peaks[0], ctx)
        )
    return metrics


class StepTimer:
    """Images per second over the epoch's steps after the first few, summed over ranks.
    Synchronises the device only at the window's edges, never per step."""

    def __init__(self, device: torch.device, planned_steps: int) -> None:
        self.device = device
        self.warmup = min(TIMING_WARMUP_STEPS, planned_steps // 2)
        self.seen = 0
        self.images = 0
        self.start: float | None = synced_clock(device) if self.warmup == 0 else None

    def tick(self, batch_images: int) -> bool:
        """Count a micro-batch; True where the timed steps start (the warm-up just ended)."""
        self.seen += 1
        if self.seen == self.warmup:
            self.start = synced_clock(self.device)
            return True
        if self.seen > self.warmup:
            self.images += batch_images
        return False

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
