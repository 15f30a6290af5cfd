"""--profile-steps A:B: one torch.profiler trace per rank of the optimizer steps after step A
up to step B, written to OUT/profile/steps{first}-{last}/rank{R}-{host}.pt.trace.json.

The folder names the steps the trace holds: a run stopped inside the window (a preemption)
and resumed writes the rest of the window into a folder of its own, beside the first part's,
and each folder is one whole set of ranks, as Holistic Trace Analysis reads it.

The trace is Chrome/Perfetto JSON (ui.perfetto.dev opens it; Holistic Trace Analysis reads a
folder of them). Each step is one `ProfilerStep#N` span, N the step number steps.jsonl gives
it, so HTA finds the iterations and a reader can match a span to its row. torch writes the
rank, world size and backend in the trace's `distributedInfo` (what HTA reads to tell the
ranks apart); ddpcli adds `ddpcli_run` beside it: rank, host, world, the window and the run.

The profiler is started at step A's end and stopped at step B's, not driven by a schedule
from the first step: outside the window nothing of it runs, and nothing is imported when
--profile-steps is off (the loop keeps no profiler at all then).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ddpcli import ui
from ddpcli.config.plan import RunPlan
from ddpcli.dist import DistContext

if TYPE_CHECKING:
    import torch.profiler

PROFILE_FOLDER = "profile"
TRACE_SUFFIX = ".pt.trace.json"  # HTA and TensorBoard's profiler plugin look for it


def trace_path(out: Path, steps: tuple[int, int], rank: int, host: str) -> Path:
    """Where rank RANK's trace of STEPS (first, last) goes."""
    first, last = steps
    return out / PROFILE_FOLDER / f"steps{first}-{last}" / f"rank{rank}-{host}{TRACE_SUFFIX}"


def step_profiler(
    cfg: RunPlan, ctx: DistContext, first_step: int, total_steps: int
) -> StepProfiler | None:
    """The profiler of --profile-steps, for a run that starts after FIRST_STEP and ends at
    TOTAL_STEPS (or --max-steps); None when the flag is off. Rank 0 says when the run cuts
    the window short."""
    window = cfg.profile_window
    if window is None:
        return None
    last_step = min(total_steps, cfg.max_steps or total_steps)
    if ctx.is_main and (note := window_note(window, first_step, last_step)):
        ui.warn(f"--profile-steps {cfg.profile_steps}: {note}")
    return StepProfiler((window[0], min(window[1], last_step)), first_step, cfg.out, ctx)


def window_note(window: tuple[int, int], first_step: int, last_step: int) -> str:
    """Why the trace will hold fewer steps than asked, in words; "" when it holds them all."""
    after, until = window
    if after >= last_step:
        return f"the run ends at step {last_step}, so no step is profiled and no trace written"
    if until <= first_step:
        return f"the run resumes after step {first_step}, past the window: no trace is written"
    held = (max(after, first_step) + 1, min(until, last_step))
    if held == (after + 1, until):
        return ""
    return f"the run covers steps {first_step + 1}-{last_step}: the trace holds {held[0]}-{held[1]}"


class StepProfiler:
    """Call `at_step(step)` where the run starts and after every optimizer step: the
    profiler runs over the steps of WINDOW (after, until], cut at the run's last step."""

    def __init__(
        self, window: tuple[int, int], first_step: int, out: Path, ctx: DistContext
    ) -> None:
        self.after, self.until = window
        self.first_step = first_step
        self.out, self.ctx = out, ctx
        self.host = socket.gethostname()
        self.profiler: torch.profiler.profile | None = None
        self.step_span: Any = None
        self.steps: list[int] = []

    def at_step(self, step: int) -> None:
        """STEP has just ended (or the run starts after it)."""
        if self.profiler is None and self.after <= step < self.until:
            self.open()
        elif self.profiler is not None and step >= self.until:
            self.finish()
            return
        if self.profiler is not None:
            self.next_span(step + 1)

    def open(self) -> None:
        import torch.profiler

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.ctx.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        with native_stderr_quiet():
            self.profiler.start()
        # After start: torch adds metadata to the trace being recorded.
        self.profiler.add_metadata_json("ddpcli_run", json.dumps(self.run_metadata()))

    def run_metadata(self) -> dict[str, Any]:
        ctx = self.ctx
        return {
            "rank": ctx.rank,
            "local_rank": ctx.local_rank,
            "world_size": ctx.world_size,
            "host": self.host,
            "backend": ctx.backend,
            "device": str(ctx.device),
            "profile_steps": [self.after, self.until],
            "run": str(self.out),
        }

    def next_span(self, step: int) -> None:
        """One `ProfilerStep#STEP` span per step, as torch's own schedule marks them."""
        from torch.autograd.profiler import record_function

        self.close_span()
        self.step_span = record_function(f"ProfilerStep#{step}")
        self.step_span.__enter__()
        self.steps.append(step)

    def close_span(self) -> None:
        if self.step_span is not None:
            self.step_span.__exit__(None, None, None)
            self.step_span = None

    def finish(self, write: bool = True) -> None:
        """Stop, and (WRITE) export the trace whole: a reader never meets half a file."""
        profiler, self.profiler = self.profiler, None
        if profiler is None:
            return
        self.close_span()
        with native_stderr_quiet():
            profiler.stop()
        if not write:
            return
        path = trace_path(self.out, (self.steps[0], self.steps[-1]), self.ctx.rank, self.host)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".part")
        profiler.export_chrome_trace(str(partial))
        os.replace(partial, path)
        if self.ctx.is_main:
            ui.info(
                f"profile of steps {self.steps[0]}-{self.steps[-1]}: one trace per rank in "
                f"{path.parent} (open in ui.perfetto.dev, or Holistic Trace Analysis)"
            )

    def __enter__(self) -> StepProfiler:
        self.at_step(self.first_step)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """The run stopped inside the window (a preemption): the steps it finished are
        written, unless it ended in an error or an interrupt (then nothing waits on an
        export)."""
        if self.profiler is None:
            return
        self.steps.pop()  # the step under way, never finished
        self.finish(write=kind is None and bool(self.steps))


@contextlib.contextmanager
def native_stderr_quiet() -> Iterator[None]:
    """Kineto writes a line to the process's stderr at each start and stop (`USDT: ...
    profiler_start`), and on a machine without GPUs an ERROR line that it found none: noise
    on every rank's terminal that says nothing to the user. Python's own stderr is flushed
    first; what other threads write in these few milliseconds is lost."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
