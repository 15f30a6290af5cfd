"""Every tracker of a run behind one object (rank 0's), each fed by a thread of its own.

Training never waits on a tracker: rows go into a queue, and the tracker's `Courier` takes
them out. A tracker that fails (at its start or mid-run) gets one warning per outage; the
courier tries again, backing off, and what the tracker missed goes when it answers again.
At the end the run waits a bounded time (EXIT_WAIT_S) and names in summary.json what was
not sent: the run folder's files stay the record.

Continuity: an append-only tracker (MLflow, W&B) is sent a row once a checkpoint holds its
step. Rows past the last checkpoint are the ones a resume trains again, and steps.jsonl
drops them (`StepLog.start`), so the tracker's history stays equal to the files: no step
twice, none missing. A continued run gets first what it missed of the files' rows
(`Tracker.logged_through`).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpcli import ui
from ddpcli.config.plan import RunPlan
from ddpcli.errors import first_line
from ddpcli.outputs.steplog import STEPS_FILE, read_rows
from ddpcli.outputs.trackers.base import Ending, Opening, RowKind, Tracker, flat_params

if TYPE_CHECKING:
    from ddpcli.dist import DistContext

START_WAIT_S = 30.0  # the longest training waits for the trackers' first try to start
EXIT_WAIT_S = 30.0  # the longest the run's end waits for each tracker to take what is left
RETRY_FIRST_S = 2.0  # a tracker that failed is tried again after this, then twice as long
RETRY_MAX_S = 60.0
METRICS_FILE = "metrics.jsonl"

Row = tuple[RowKind, dict[str, Any]]


@dataclass
class Op:
    """One thing for a tracker to do, in order: rows, files, or the run's end."""

    rows: list[Row] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    ending: Ending | None = None
    done: threading.Event = field(default_factory=threading.Event)


def run_opening(cfg: RunPlan, ctx: DistContext, resume_step: int) -> Opening:
    """What the trackers are told at the start: the names, the flat config.json, the
    system's facts, and the rows the run folder's files hold (rewound to RESUME_STEP)."""
    out = cfg.out
    earlier: list[Row] = [("step", row) for row in read_rows(out / STEPS_FILE)]
    earlier += [("epoch", row) for row in read_rows(out / METRICS_FILE)]
    return Opening(
        out=out,
        experiment=cfg.experiment or f"{cfg.arch}-{cfg.dataset}",
        run_name=cfg.run_name or out.resolve().name,
        tracking_uri=cfg.tracking_uri,
        params=flat_params(json.loads(cfg.model_dump_json())),
        tags=system_tags(ctx),
        resume_step=resume_step,
        wandb_offline=cfg.wandb_offline,
        earlier=earlier,
    )


def system_tags(ctx: DistContext) -> dict[str, str]:
    import torch

    from ddpcli import __version__

    tags = {
        "world_size": str(ctx.world_size),
        "backend": ctx.backend,
        "device": ctx.device.type,
        "gpus": "0",
        "torch": torch.__version__,
        "ddpcli": __version__,
    }
    if ctx.device.type == "cuda":
        tags["gpus"] = str(ctx.world_size)  # one process per GPU
        tags["gpu_name"] = torch.cuda.get_device_name(ctx.device)
    return tags


def tracker_for(name: str) -> Tracker:
    """The tracker NAME; its module imports its package only when it starts."""
    if name == "csv":
        from ddpcli.outputs.trackers.csv_tracker import CsvTracker

        return CsvTracker()
    if name == "mlflow":
        from ddpcli.outputs.trackers.mlflow_tracker import MlflowTracker

        return MlflowTracker()
    if name == "wandb":
        from ddpcli.outputs.trackers.wandb_tracker import WandbTracker

        return WandbTracker()
    if name == "tensorboard":
        from ddpcli.outputs.trackers.tensorboard_tracker import TensorBoardTracker

        return TensorBoardTracker()
    raise ValueError(f"no tracker {name!r}")


class Courier:
    """One tracker's thread: it starts the tracker's run, then does each Op in order; an Op
    that fails is tried again (backing off) until it goes through or the run ends."""

    def __init__(self, tracker: Tracker, opening: Opening, run_ids: dict[str, str]) -> None:
        self.tracker, self.opening, self.run_ids = tracker, opening, run_ids
        self.ops: queue.Queue[Op | None] = queue.Queue()
        self.started = False
        self.closing = threading.Event()  # the run ends: one more try, then give up
        self.gave_up = False
        self.down: str | None = None  # why the tracker does not answer, while it does not
        self.held_ops: list[Op] = []  # tried while it did not answer: sent when it does
        self.unsent: list[Op] = []
        self.current: Op | None = None
        self.first_try = threading.Event()  # the run started, or failed to once
        self.thread = threading.Thread(
            target=self.serve, name=f"ddpcli-tracker-{tracker.name}", daemon=True
        )
        self.thread.start()
        self.send(Op())  # start the run now: its id is in the first checkpoint

    @property
    def name(self) -> str:
        return self.tracker.name

    def send(self, op: Op) -> Op:
        self.ops.put(op)
        return op

    def serve(self) -> None:
        while (op := self.ops.get()) is not None:
            self.current = op
            self.deliver(op)
            self.current = None
            op.done.set()

    def deliver(self, op: Op) -> None:
        wait = RETRY_FIRST_S
        while not self.gave_up:
            try:
                self.ensure_started()
                self.perform(op)
            except Exception as error:  # a tracker's failure is never the run's
                self.first_try.set()
                self.failed(op, error)
                if self.closing.is_set():
                    self.gave_up = True
                    break
                self.closing.wait(wait)
                wait = min(2 * wait, RETRY_MAX_S)
                continue
            self.first_try.set()
            self.answered()
            return
        self.unsent.append(op)

    def ensure_started(self) -> None:
        if self.started:
            return
        run_id = self.tracker.start(self.opening)
        if run_id:
            self.run_ids[self.name] = run_id
            self.opening.run_id = run_id  # a try again continues this run, it opens no other
        if self.tracker.append_only:
            self.send_earlier_rows()
        self.started = True

    def send_earlier_rows(self) -> None:
        """A continued run holds the files' rows up to some step; those after it (sent
        after the checkpoint the run resumes from, by a run that then stopped with the
        tracker unreachable; or every row, for a run that had none, a new run in a store
        that lacks the checkpoint's) go now."""
        through = self.tracker.logged_through()
        if through is None:
            through = {"step": -1, "epoch": -1} if self.opening.run_id is None else None
        if through is not None:
            earlier = self.opening.earlier
            rows = [
                (kind, row)
                for kind, row in earlier
                if row["step"] > through[kind] and not row.get("partial")  # CSV's only
            ]
            if rows:
                self.tracker.log_rows(rows)

    def perform(self, op: Op) -> None:
        if op.rows:
            self.tracker.log_rows(op.rows)
        if op.files:
            self.tracker.log_files(op.files)
        if op.ending is not None:
            self.tracker.finish(op.ending)

    def failed(self, op: Op, error: Exception) -> None:
        if self.down is None:
            self.down = failure_line(error)
            ui.warn(
                f"--tracker {self.name}: {self.down}; training goes on (the run folder's files "
                "stay the record), and what it misses is sent when it answers again"
            )
        if not any(op is held for held in self.held_ops):
            self.held_ops.append(op)

    def answered(self) -> None:
        if self.down is None:
            return
        rows = [row for op in self.held_ops for row in op.rows] + list(queued_rows(self.ops))
        self.down = None
        self.held_ops.clear()
        ui.info(f"--tracker {self.name} answers again: sending what it missed ({spans(rows)})")

    def close(self, deadline: float) -> None:
        """No more Ops; waits for the thread until DEADLINE (monotonic)."""
        self.closing.set()
        self.ops.put(None)
        self.thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def left_rows(self) -> list[Row]:
        """Rows that did not reach the tracker: given up on, or still waiting."""
        ops = list(self.unsent)
        if self.thread.is_alive():
            ops += [self.current] if self.current is not None else []
        rows = [row for op in ops for row in op.rows] + list(queued_rows(self.ops))
        if self.started or not self.tracker.append_only or self.opening.run_id is not None:
            return rows
        return self.opening.earlier + rows


def queued_rows(ops: queue.Queue[Op | None]) -> Iterable[Row]:
    for op in list(ops.queue):
        if op is not None:
            yield from op.rows


def spans(rows: list[Row]) -> str:
    """`steps 10-40 (4 rows), epochs 1-2`: what ROWS cover, in words."""
    words = []
    for kind, label in (("step", "steps"), ("epoch", "epoch rows at steps")):
        steps = [row["step"] for row_kind, row in rows if row_kind == kind]
        if steps:
            rows_word = "row" if len(steps) == 1 else "rows"
            words.append(f"{label} {min(steps)}-{max(steps)} ({len(steps)} {rows_word})")
    return ", ".join(words) or "no rows"


def failure_line(error: BaseException) -> str:
    """ERROR's first line after its type: a tracker library's errors often say little alone."""
    said, kind = first_line(error), type(error).__name__
    return kind if said == kind else f"{kind}: {said}"


class Trackers:
    """The run's trackers (rank 0's; every other rank's is empty). RUN_IDS is the dict the
    checkpoint keeps (TrainState.tracker_runs): each tracker's run id goes in as it starts."""

    def __init__(self, names: list[str], run_ids: dict[str, str]) -> None:
        self.names = names
        self.run_ids = run_ids
        self.couriers: list[Courier] = []
        self.pending: list[Row] = []  # for the append-only trackers: no checkpoint holds them yet
        self.closed = False

    def start(self, opening: Opening) -> None:
        for name in self.names:
            tracker = tracker_for(name)
            own = Opening(**{**vars(opening), "run_id": self.run_ids.get(name), "notes": []})
            self.couriers.append(Courier(tracker, own, self.run_ids))
        # Bounded: a tracker that is slow to answer starts (or not) while training goes on.
        deadline = time.monotonic() + START_WAIT_S
        for courier in self.couriers:
            courier.first_try.wait(timeout=max(0.0, deadline - time.monotonic()))
            if courier.started and (where := courier.tracker.where()):
                ui.info(f"--tracker {courier.name}: {where}")

    # --- rows: the Sink StepLog writes to beside steps.jsonl
    def step_row(self, row: dict[str, Any]) -> None:
        self.take(("step", dict(row)))

    def epoch_row(self, row: dict[str, Any]) -> None:
        """Every row of metrics.jsonl, a partial epoch's too (a stop inside the epoch): only
        the CSV files keep that one, which the resume's metrics.jsonl replaces."""
        self.take(("epoch", dict(row)))

    def take(self, row: Row) -> None:
        for courier in self.live():
            if not row[1].get("partial") or courier.name == "csv":
                courier.send(Op(rows=[row]))
        if self.append_only() and not row[1].get("partial"):
            self.pending.append(row)

    def checkpoint_saved(self, step: int) -> None:
        """A checkpoint at STEP is written: the rows up to it are the run's for good."""
        ready = [row for row in self.pending if row[1]["step"] <= step]
        self.pending = [row for row in self.pending if row[1]["step"] > step]
        if ready:
            for courier in self.append_only():
                courier.send(Op(rows=ready))

    def live(self) -> list[Courier]:
        return [courier for courier in self.couriers if not courier.tracker.append_only]

    def append_only(self) -> list[Courier]:
        return [courier for courier in self.couriers if courier.tracker.append_only]

    # --- the end
    def rows_report(self) -> dict[str, Any]:
        """Waits (bounded) for the rows to go; what each tracker holds, for summary.json."""
        if not self.couriers:
            return {}
        fences = [courier.send(Op()) for courier in self.couriers]
        deadline = time.monotonic() + EXIT_WAIT_S
        for courier in self.couriers:
            courier.closing.set()  # one more try for a tracker that does not answer
        for fence in fences:
            fence.done.wait(timeout=max(0.0, deadline - time.monotonic()))
        return {"trackers": {courier.name: self.report_of(courier) for courier in self.couriers}}

    def report_of(self, courier: Courier) -> dict[str, Any]:
        report: dict[str, Any] = {}
        if courier.name in self.run_ids:
            report["run_id"] = self.run_ids[courier.name]
        left = courier.left_rows()
        if courier.tracker.append_only:
            left += self.pending
        if left:
            report["not_sent"] = spans(left)
            why = courier.down or "still sending at the run's end"
            ui.warn(
                f"--tracker {courier.name}: {spans(left)} not sent ({why}); steps.jsonl and "
                "metrics.jsonl hold them"
            )
        return report

    def finish(self, files: list[Path], ending: Ending) -> None:
        """The run's files as artifacts, the run's end, then each thread's (bounded) wait."""
        if self.closed:
            return
        self.closed = True
        present = [path for path in files if path.is_file()]
        for courier in self.couriers:
            courier.closing.set()
            courier.send(Op(files=present, ending=ending))
        deadline = time.monotonic() + EXIT_WAIT_S
        for courier in self.couriers:
            courier.close(deadline)
            if courier.thread.is_alive():
                ui.warn(
                    f"--tracker {courier.name}: did not answer within {EXIT_WAIT_S:g} s at "
                    "the run's end; left as it was"
                )
            for note in courier.opening.notes:
                ui.info(note)

    def stop(self, ending: Ending) -> None:
        """The run stops without its summary (an error, Ctrl-C): the rows past the last
        checkpoint stay unsent, since a resume trains those steps again."""
        if self.closed or not self.couriers:
            return
        if self.pending:
            ui.info(
                f"--tracker: {spans(self.pending)} past the last checkpoint not sent to "
                f"{', '.join(c.name for c in self.append_only())}; a resume trains them "
                "again and sends them"
            )
        self.finish([], ending)
