"""Where each rank's step time goes, and which rank holds the others up.

Per rank: the seconds it waited for its next batch, and the seconds of its own compute
(forward and loss, backward up to its last gradient, the optimizer step). Its own compute
leaves out DDP's two waits for the other ranks: the buffer broadcast before the model's
forward (it starts when the wrapped module's forward does) and the end of backward, where
the gradient all-reduce completes (it ends at the last gradient accumulated). In those
every rank waits for the slowest, so timed over the whole step every rank would look as
slow as the slowest one, and none could be named. Those two waits are the communication
that backward did not hide (exposed): the all-reduces that overlapped backward cost
nothing there. With the optimizer step and the epoch's wall time beside them, each rank's
step splits into data wait, compute, exposed communication, optimizer and the rest (the
metric sums, logging, a checkpoint): `step_breakdown`.

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
# Fewer timed optimizer steps (those after the warm-up ones) give figures too noisy to warn
# on (a busy core): they are still recorded, but no warning line names a rank.
STEPS_TO_WARN = 5
METRIC_SLOTS = 3  # the loop's own sums come first: [loss sum, correct, count]
# Each rank's slots: [data wait, compute, exposed communication, optimizer, wall] seconds.
RANK_SLOTS = 5
BREAKDOWN_PARTS = ("data_wait", "compute", "exposed_comm", "optimizer")

Batch = TypeVar("Batch")


def slots_for(world_size: int) -> int:
    """Length of the loop's sums tensor: its metrics, then RANK_SLOTS for each rank."""
    return METRIC_SLOTS + RANK_SLOTS * world_size


class RankClock:
    """This rank's wait, compute, exposed communication and optimizer seconds in the
    current epoch."""

    def __init__(self, module: nn.Module, hook_forward: bool = True) -> None:
        """MODULE: the model inside any DDP wrapper, so that its forward starts after DDP's
        buffer broadcast. HOOK_FORWARD False (under torch.compile, where a clock read in a
        hook would break the graph): the compute then starts before that broadcast."""
        self.wait_s = self.compute_s = self.comm_s = self.optimizer_s = 0.0
        self.steps = 0  # optimizer steps timed
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
        if self.training:  # what DDP did before it: the buffer broadcast
            now = time.perf_counter()
            self.comm_s += now - self.started
            self.started = now

    def _gradient_ready(self, _parameter: torch.Tensor) -> None:
        self.last_gradient_at = time.perf_counter()

    def start_epoch(self) -> None:
        """From here (the epoch's start, then again after the warm-up steps that images/s
        leaves out too: a GPU's first steps autotune for seconds)."""
        self.wait_s = self.compute_s = self.comm_s = self.optimizer_s = 0.0
        self.steps = 0
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
        last_gradient_at = self.last_gradient_at or now
        self.compute_s += last_gradient_at - self.started
        self.comm_s += now - last_gradient_at
        self.started = now

    def compute_done(self, optimizer_stepped: bool) -> None:
        self.training = False  # validation's forwards are not timed
        if optimizer_stepped:  # the optimizer step (nothing else ran since backward_done)
            self.optimizer_s += time.perf_counter() - self.started
            self.steps += 1

    def epoch_seconds(self) -> float:
        return time.perf_counter() - self.epoch_started

    def write(self, sums: torch.Tensor, rank: int) -> None:
        """Put this rank's epoch figures in its slots of SUMS, ahead of the reduction."""
        slot = METRIC_SLOTS + RANK_SLOTS * rank
        figures = (self.wait_s, self.compute_s, self.comm_s, self.optimizer_s)
        sums[slot : slot + RANK_SLOTS] = sums.new_tensor([*figures, self.epoch_seconds()])


def rank_seconds(timing: list[float]) -> tuple[list[float], list[float]]:
    """Per-rank (wait, own compute) seconds from the rank slots of the reduced sums (what
    follows their first METRIC_SLOTS values); own compute holds the optimizer step."""
    wait_s = timing[0::RANK_SLOTS]
    compute_s = [a + b for a, b in zip(timing[1::RANK_SLOTS], timing[3::RANK_SLOTS], strict=True)]
    return wait_s, compute_s


def step_breakdown(timing: list[float], steps: int) -> dict[str, Any]:
    """Each rank's step time, split into BREAKDOWN_PARTS and `other` as shares of its wall
    time (they sum to 1), with its mean step in ms; and the slowest rank: the one whose own
    work (all but the exposed communication and `other`) is longest, which every rank waits
    for. TIMING: the rank slots of the reduced sums, over STEPS optimizer steps."""
    per_rank = []
    own_s = []
    for rank in range(len(timing) // RANK_SLOTS):
        *parts, wall = timing[rank * RANK_SLOTS : (rank + 1) * RANK_SLOTS]
        wall = max(wall, 1e-9)
        named = zip(BREAKDOWN_PARTS, parts, strict=True)
        shares = {name: min(seconds / wall, 1.0) for name, seconds in named}
        shares["other"] = max(0.0, 1.0 - sum(shares.values()))
        rounded = {name: round(share, 4) for name, share in shares.items()}
        per_rank.append({"rank": rank, "step_ms": round(1000 * wall / max(steps, 1), 2), **rounded})
        own_s.append(parts[0] + parts[1] + parts[3])
    slowest = max(range(len(own_s)), key=own_s.__getitem__, default=0)
    return {"per_rank": per_rank, "slowest_rank": slowest, "steps": steps, "clock": "host"}


def breakdown_lines(breakdown: dict[str, Any], most: int = 8) -> list[str]:
    """The breakdown for a person: one line per rank (the slowest and the first MOST)."""
    slowest = breakdown["slowest_rank"]
    shown = [row for row in breakdown["per_rank"] if row["rank"] < most or row["rank"] == slowest]
    lines = [
        f"rank {row['rank']}: {row['step_ms']:.1f} ms per step = data wait "
        f"{100 * row['data_wait']:.0f}% · compute {100 * row['compute']:.0f}% · exposed comm "
        f"{100 * row['exposed_comm']:.0f}% · optimizer {100 * row['optimizer']:.0f}% · other "
        f"{100 * row['other']:.0f}%" + (" (the slowest: every rank waits for it)" if
        row["rank"] == slowest and len(breakdown["per_rank"]) > 1 else "")
        for row in shown
    ]  # fmt: skip
    hidden = len(breakdown["per_rank"]) - len(shown)
    if hidden:
        lines.append(f"... {hidden} more ranks in summary.json's step_breakdown")
    return lines


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
