"""Latency of barrier() and the collectives, measured the way nccl-tests measures them."""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter as clock
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddpcli import ui
from ddpcli.barrier.rank import BenchRank, gather_to_rank0
from ddpcli.config import BarrierConfig
from ddpcli.dist import DistContext
from ddpcli.timing import bandwidth_gbps, percentiles_us, synchronize, time_calls_ns

PROGRESS_EVERY_S = 10.0  # a long latency run says how far it is this often (rank 0)
ESTIMATE_CALLS = 100  # without a warm-up, the first calls timed give the estimate
COLLECTIVE_BYTES_PER_SIZE = 512 << 20  # big messages run fewer iterations: about this much each
MIN_COLLECTIVE_ITERS = 3


def barrier_call(ctx: DistContext) -> Callable[[], Any]:
    if ctx.backend != "nccl":
        return dist.barrier
    device = ctx.device

    def barrier_on_device() -> None:
        # NCCL's barrier is an all_reduce on the device: time it until the device is done.
        dist.barrier()
        torch.cuda.synchronize(device)

    return barrier_on_device


def measure_latency(bench: BenchRank, cfg: BarrierConfig) -> dict | None:
    barrier_once = barrier_call(bench.ctx)
    warmup_ns = time_calls_ns(barrier_once, cfg.warmup)
    if bench.ctx.is_main:
        samples_ns = time_calls_with_progress(barrier_once, cfg.iters, warmup_ns)
    else:  # every rank makes the same calls; only how rank 0 splits them differs
        samples_ns = time_calls_ns(barrier_once, cfg.iters)
    samples_us = np.asarray(samples_ns, dtype=np.float64) / 1e3
    everyone = gather_to_rank0(bench, samples_us)
    if everyone is None:
        return None
    per_rank = [{"rank": rank, **percentiles_us(s)} for rank, s in enumerate(everyone)]
    overall = percentiles_us(np.concatenate(everyone))
    overall.update(iters=cfg.iters, warmup=cfg.warmup)
    return {"latency_us": overall, "latency_us_per_rank": per_rank}


def time_calls_with_progress(
    call: Callable[[], Any], count: int, warmup_ns: list[int]
) -> list[int]:
    """time_calls_ns(call, count), in pieces of about PROGRESS_EVERY_S: a run estimated to
    take longer than that says so up front (from the warm-up's pace), then how far it is."""
    samples: list[int] = []
    if not warmup_ns:
        samples += time_calls_ns(call, min(count, ESTIMATE_CALLS))
    paced = warmup_ns or samples
    per_call_s = max(float(np.median(paced)) / 1e9, 1e-9) if paced else 0.0
    if per_call_s * count <= PROGRESS_EVERY_S:
        return samples + time_calls_ns(call, count - len(samples))
    ui.info(
        f"timing {count:,} barriers on each rank: about {duration_words(per_call_s * count)} "
        f"at {per_call_s * 1e6:.0f} µs each (the pace of the first calls); progress every "
        f"{PROGRESS_EVERY_S:g} s"
    )
    piece, done_before, started = max(1, int(PROGRESS_EVERY_S / per_call_s)), len(samples), clock()
    while len(samples) < count:
        samples += time_calls_ns(call, min(piece, count - len(samples)))
        elapsed = clock() - started
        pace_s = elapsed / (len(samples) - done_before)  # the pace so far sets the next piece
        piece = max(1, int(PROGRESS_EVERY_S / pace_s))
        left_s = pace_s * (count - len(samples))
        if len(samples) < count:
            ui.info(
                f"barriers: {len(samples):,} of {count:,} ({len(samples) / count:.0%}) · "
                f"{duration_words(elapsed)} in · about {duration_words(left_s)} left"
            )
    return samples


def duration_words(seconds: float) -> str:
    """0.2 s, 45 s, 3 min 20 s, 2 h 5 min."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


# --- Collectives, measured the way nccl-tests measures them -------------------------------


def collective_call(name: str, size_bytes: int, world_size: int, device) -> tuple[Callable, int]:
    """The operation to time and the bytes it moves as nccl-tests counts them (float32;
    all_gather's size is the gathered output, each rank contributing 1/n of it)."""
    elements = max(1, -(-size_bytes // 4))
    if name == "all_gather":
        contribution = torch.zeros(max(1, elements // world_size), device=device)
        gathered = torch.empty(contribution.numel() * world_size, device=device)
        gather = all_gather_one_tensor()
        return (lambda: gather(gathered, contribution)), gathered.numel() * 4
    # Zeros: a sum of zeros stays zero, so repeated all_reduces never overflow.
    tensor = torch.zeros(elements, device=device)
    if name == "all_reduce":
        return (lambda: dist.all_reduce(tensor)), tensor.numel() * 4
    return (lambda: dist.broadcast(tensor, src=0)), tensor.numel() * 4


def all_gather_one_tensor() -> Callable:
    """all_gather into one output tensor (nccl-tests' layout): torch 2.14 renamed it."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def collective_iterations(size_bytes: int, iters: int) -> int:
    """Every rank must run the same count: it depends on the size only, never on a clock."""
    return max(1, min(iters, max(MIN_COLLECTIVE_ITERS, COLLECTIVE_BYTES_PER_SIZE // size_bytes)))


def measure_collective(bench: BenchRank, cfg: BarrierConfig, name: str, size: int) -> dict:
    ctx = bench.ctx
    device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
    operation, moved = collective_call(name, size, ctx.world_size, device)
    iterations = collective_iterations(moved, cfg.iters)
    for _ in range(min(cfg.warmup, iterations) or 1):
        operation()
    synchronize(device)
    dist.barrier(group=bench.control)
    started = clock()
    for _ in range(iterations):
        operation()
    synchronize(device)
    # Like nccl-tests: the time of one operation, averaged over the ranks.
    per_op = torch.tensor([(clock() - started) / iterations], dtype=torch.float64)
    dist.all_reduce(per_op, group=bench.control)
    seconds = per_op.item() / ctx.world_size
    return {
        "collective": name,
        "size_bytes": moved,
        "count": moved // 4,
        "dtype": "float32",
        "iters": iterations,
        "time_us": round(seconds * 1e6, 2),
        **collective_bandwidth(name, moved, seconds, ctx.world_size),
    }


def collective_bandwidth(name: str, moved: int, seconds: float, world_size: int) -> dict:
    """nccl-tests' algbw and busbw, rounded; None for one rank, whose collective moves no
    byte anywhere (a broadcast "at 44 TB/s" is a copy that never happened)."""
    bandwidth = bandwidth_gbps(name, moved, seconds, world_size)
    if world_size == 1:
        return dict.fromkeys(bandwidth)
    return {key: round(value, 4) for key, value in bandwidth.items()}
