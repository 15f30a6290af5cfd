"""How ddpcli times collectives: one clock, one device sync, one set of percentiles and
nccl-tests' bus-bandwidth factors, shared by bench-barrier and check-env's probe."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

# nccl-tests' bus bandwidth: the factor that makes figures comparable across rank counts.
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def synchronize(device: torch.device) -> None:
    """Wait until the device has run everything queued so far (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synced_clock(device: torch.device) -> float:
    """perf_counter() once the device's queued work is done: the edge of a timed window."""
    synchronize(device)
    return time.perf_counter()


def time_calls_ns(call: Callable[[], Any], count: int) -> list[int]:
    """Nanoseconds per call. Two clock reads and a list store are all this adds to a bare
    loop of calls (benchmarks/barrier_overhead.py measures it)."""
    now = time.perf_counter_ns
    samples = [0] * count
    for index in range(count):
        started = now()
        call()
        samples[index] = now() - started
    return samples


def percentiles_us(samples_us: Sequence[float] | np.ndarray) -> dict[str, float]:
    p50, p90, p99 = np.percentile(samples_us, [50, 90, 99])
    return {
        "p50": round(float(p50), 2),
        "p90": round(float(p90), 2),
        "p99": round(float(p99), 2),
        "max": round(float(np.max(samples_us)), 2),
    }


def bandwidth_gbps(
    collective: str, moved_bytes: int, seconds: float, world_size: int
) -> dict[str, float]:
    """Algorithm and bus bandwidth in GB/s, as nccl-tests reports them."""
    algbw = moved_bytes / max(seconds, 1e-12) / 1e9
    return {"algbw_GBps": algbw, "busbw_GBps": algbw * BUS_FACTOR[collective](world_size)}
