"""Where each rank's step time goes, and which rank holds the others up.

Per rank: the seconds it waited for its next batch, and the seconds of its own compute
(forward and loss, backward up to its last gradient, the optimizer step). Its own compute
leaves out DDP's two waits for the other ranks: the buffer broadcast before the model's
forward (it starts when the wrapped module's forward does) and the end of backward, where
the gradient all-reduce completes (it ends at the last gradient accumulated). In those
every rank waits for the slowest, so timed over the whole step every rank would look as
slow as the slowest one, and none could be named.

The figures ride in the loop's metric sums (two slots per rank, this rank's filled, the
others zero), so the reduction the loop already makes at its logging points gathers them
for every rank: no collective and no host synchronisation of their own. Host clocks: on
the CPU they are the compute itself; on a GPU they are the time to issue the work, which
tracks the device's only while its queue is full.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # the CLI reports with this module and must not import torch
    import torch
    from torch import nn

# A rank this much slower than the median rank is named: in DDP every rank waits for it.
STRAGGLER_EXCESS = 0.10
# A data wait above this share of the step gets a hint: the input pipeline is the limit.
DATA_WAIT_HINT = 0.25
# An epoch of fewer optimizer steps gives figures too noisy to warn on (a busy core, the
# first step's allocations): they are still recorded, but no warning line names a rank.
STEPS_TO_WARN = 8
METRIC_SLOTS = 3  # the loop's own sums come first: [loss sum, correct, count]

Batch = TypeVar("Batch")


def slots_for(world_size: int) -> int:
    """Length of the loop's sums tensor: its metrics, then [wait, compute] for each rank."""
    return METRIC_SLOTS + 2 * world_size


class RankClock:
    """This rank's wait and compute seconds in the current epoch."""

    def __init__(self, module: nn.Module, hook_forward: bool = True) -> None:
        """MODULE: the model inside any DDP wrapper, so that its forward starts after DDP's
        buffer broadcast. HOOK_FORWARD False (under torch.compile, where a clock read in a
        hook would break the graph): the compute then starts before that broadcast."""
        self.wait_s = self.compute_s = 0.0
        self.epoch_started = time.perf_counter()
        self.started = 0.0
        self.training = False  # inside a training micro-step
        self.last_gradient_at: float | None = None
        if hook_forward:
            module.register_forward_pre_hook(self._forward_starts)
        for parameter in module.parameters():
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(self._gradient_ready)

    def _forward_starts(self, *_: object) -> None:
        if self.training:
            self.started = time.perf_counter()

    def _gradient_ready(self, _parameter: torch.Tensor) -> None:
        self.last_gradient_at = time.perf_counter()

    def start_epoch(self) -> None:
        self.wait_s = self.compute_s = 0.0
        self.epoch_started = time.perf_counter()

    def waited(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """BATCHES, with the time spent waiting for each one added to wait_s."""
        iterator = iter(batches)
        while True:
            asked = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.wait_s += time.perf_counter() - asked
            yield batch

    def compute_started(self) -> None:
        self.training = True
        self.started = time.perf_counter()
        self.last_gradient_at = None

    def backward_done(self) -> None:
        """Backward returned: its own part ended at the last gradient, the rest was the wait
        for the all-reduce."""
        now = time.perf_counter()
        self.compute_s += (self.last_gradient_at or now) - self.started
        self.started = now

    def compute_done(self, optimizer_stepped: bool) -> None:
        self.training = False  # validation's forwards are not timed
        if optimizer_stepped:  # the optimizer step (nothing else ran since backward_done)
            self.compute_s += time.perf_counter() - self.started

    def epoch_seconds(self) -> float:
        return time.perf_counter() - self.epoch_started

    def write(self, sums: torch.Tensor, rank: int) -> None:
        """Put this rank's epoch figures in its slots of SUMS, ahead of the reduction."""
        slot = METRIC_SLOTS + 2 * rank
        sums[slot] = self.wait_s
        sums[slot + 1] = self.compute_s


def rank_seconds(timing: list[float]) -> tuple[list[float], list[float]]:
    """Per-rank (wait, compute) seconds from the rank slots of the reduced sums (what
    follows their first METRIC_SLOTS values)."""
    return timing[0::2], timing[1::2]


def rank_figures(
    wait_s: list[float], compute_s: list[float], wall_s: float, steps: int
) -> dict[str, Any]:
    """The figures steps.jsonl, metrics.jsonl and the summary carry, over WALL_S seconds and
    STEPS optimizer steps: each rank's data-wait share and compute per step, their mean,
    and the slowest rank when it holds the others up."""
    wall_s, steps = max(wall_s, 1e-9), max(steps, 1)
    wait_frac = [min(wait / wall_s, 1.0) for wait in wait_s]
    own_s = [wait + compute for wait, compute in zip(wait_s, compute_s, strict=True)]
    median = statistics.median(own_s) if own_s else 0.0
    slowest = max(range(len(own_s)), key=own_s.__getitem__, default=0)
    excess = own_s[slowest] / median - 1 if median > 0 else 0.0
    named = excess > STRAGGLER_EXCESS
    return {
        "data_wait_frac": round(statistics.fmean(wait_frac), 4) if wait_frac else 0.0,
        "data_wait_frac_per_rank": [round(frac, 4) for frac in wait_frac],
        "compute_ms_per_rank": [round(1000 * compute / steps, 2) for compute in compute_s],
        "slowest_rank": slowest if named else None,
        "slowest_rank_excess": round(excess, 4) if named else 0.0,
        "timed_steps": steps,
    }


def straggler_note(metrics: dict[str, Any]) -> str:
    """One line for the user when a rank holds the others up or the data path is the limit;
    "" otherwise."""
    if "data_wait_frac_per_rank" not in metrics:
        return ""
    if metrics.get("timed_steps", STEPS_TO_WARN) < STEPS_TO_WARN:
        return ""
    fractions = metrics["data_wait_frac_per_rank"]
    slowest = metrics.get("slowest_rank")
    parts = []
    if slowest is not None:
        compute = metrics["compute_ms_per_rank"][slowest]
        parts.append(
            f"rank {slowest} is the slowest, {100 * metrics['slowest_rank_excess']:.0f}% slower "
            f"than the median rank (data wait {100 * fractions[slowest]:.0f}% of the step, "
            f"compute {compute:.1f} ms per step); every rank waits for it"
        )
    worst = fractions[slowest] if slowest is not None else max(fractions, default=0.0)
    if worst > DATA_WAIT_HINT:
        parts.append(f"waiting for data takes {100 * worst:.0f}% of the step: {data_hint(metrics)}")
    return "; ".join(parts)


def data_hint(metrics: dict[str, Any]) -> str:
    path = metrics.get("data_path", "")
    if path == "device":  # batches are already cut on the device: something else is slow
        return "the batches are already made on the device; look for other work on that core"
    return f"raise --workers or try --data-path device (data path now: {path or 'loader'})"
