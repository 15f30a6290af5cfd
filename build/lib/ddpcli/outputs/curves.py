"""Training curves of one or several run folders: read from `steps.jsonl` (train values per
logging interval) and `metrics.jsonl` (validation per epoch), drawn as a picture with
matplotlib (Agg) or as text with plotext.

Both libraries are imported only when something is drawn: `ddpcli --help` stays quick,
and reading a run never needs torch. The files may belong to a run that is still going
(or was killed): a line cut short is left out, not an error.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ddpcli.errors import USAGE, DdpcliError, usage_error
from ddpcli.files import write_bytes_atomic
from ddpcli.outputs.steplog import STEPS_FILE, read_rows

CURVES_FILE = "curves.png"
METRICS_FILE = "metrics.jsonl"
PICTURE_FORMATS = ("png", "svg", "pdf")

# A panel of the picture -> the series drawn in it: train per step, validation per epoch.
PANELS: dict[str, tuple[str, ...]] = {
    "loss": ("train_loss", "val_loss"),
    "acc": ("train_acc", "val_acc"),
    "lr": ("lr",),
    "images_per_sec": ("images_per_sec",),
}
DEFAULT_PANELS = ("loss", "acc", "lr")
TITLES = {
    "loss": "loss",
    "acc": "accuracy",
    "lr": "learning rate",
    "images_per_sec": "images/s (all ranks)",
}
EPOCH_SERIES = ("val_loss", "val_acc")  # only metrics.jsonl has them


@dataclass
class Series:
    steps: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    per_epoch: bool = False


@dataclass
class RunCurves:
    label: str  # the run's name in legends
    folder: Path
    series: dict[str, Series]

    @property
    def last_step(self) -> int:
        return int(max((s.steps[-1] for s in self.series.values() if s.steps), default=0))


class NotARun(DdpcliError):
    """FOLDER has no curves to draw; REASON says why, in words that follow "FOLDER"."""

    def __init__(self, folder: Path, reason: str, hint: str) -> None:
        super().__init__(f"invalid RUN_DIR: {folder} {reason}; {hint}", USAGE)
        self.folder = folder
        self.reason = reason


LOGGED_HINT = "give the --out folder of a `ddpcli train` run that has logged at least one interval"


def read_run(folder: Path, label: str | None = None) -> RunCurves:
    """The curves in FOLDER; exit 2 when it holds none (not a run, or one not logged yet)."""
    if not folder.is_dir():
        raise NotARun(folder, "is not a folder", "give a run's --out folder")
    step_rows, epoch_rows = read_rows(folder / STEPS_FILE), read_rows(folder / METRICS_FILE)
    if not step_rows and not epoch_rows:
        raise NotARun(folder, f"holds no metrics ({STEPS_FILE} or {METRICS_FILE})", LOGGED_HINT)
    series = {}
    for name in (*PANELS["loss"], *PANELS["acc"], "lr", "images_per_sec"):
        # A run from before steps.jsonl existed still shows its train curves, per epoch.
        per_epoch = name in EPOCH_SERIES or not any(name in row for row in step_rows)
        series[name] = points(epoch_rows if per_epoch else step_rows, name, per_epoch)
    if not any(found.steps for found in series.values()):  # rows, but none a run writes
        rows = f"{STEPS_FILE} or {METRICS_FILE}"
        reason = f"holds no metrics (no row of its {rows} has a step and a value)"
        raise NotARun(folder, reason, LOGGED_HINT)
    return RunCurves(label or folder.name, folder, series)


def points(rows: list[dict], name: str, per_epoch: bool) -> Series:
    """(step, value) of every row holding a finite NAME (null: a value that was not finite)."""
    found = Series(per_epoch=per_epoch)
    for row in rows:
        step, value = row.get("step"), row.get(name)
        if not isinstance(step, (int, float)) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            found.steps.append(step)
            found.values.append(value)
    return found


def read_runs(folders: Sequence[Path]) -> tuple[list[RunCurves], list[NotARun]]:
    """Runs named by their folder (by the path given where two folders share a name), and
    the folders skipped for holding none: `runs/*` may match a run stopped before its first
    interval, or a stray file. One folder without metrics, or none among several: exit 2."""
    names = [folder.name or str(folder) for folder in folders]
    shared = {name for name in names if names.count(name) > 1}
    runs, skipped = [], []
    for folder, name in zip(folders, names, strict=True):
        try:
            runs.append(read_run(folder, str(folder) if name in shared else name))
        except NotARun as missing:
            if len(folders) == 1:
                raise
            skipped.append(missing)
    if not runs:
        raise usage_error(
            f"invalid RUN_DIR: none of the {len(folders)} RUN_DIRs holds metrics ({STEPS_FILE} "
            f"or {METRICS_FILE} rows); give the --out folders of `ddpcli train` runs that have "
            "logged at least one interval"
        )
    return runs, skipped


def choose_panels(metrics: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """--metric names: a panel (`loss`: train and validation) or one series (`val_acc`);
    none: loss, accuracy and learning rate."""
    chosen: dict[str, list[str]] = {}
    for name in metrics or DEFAULT_PANELS:
        if name in PANELS:
            chosen[name] = list(PANELS[name])
            continue
        panel = next((key for key, names in PANELS.items() if name in names), None)
        if panel is None:
            known = ", ".join([*PANELS, *(n for names in PANELS.values() for n in names)])
            raise usage_error(f"invalid --metric: {name!r} is not one of {known}")
        chosen.setdefault(panel, [])
        if name not in chosen[panel]:
            chosen[panel].append(name)
    return [(panel, tuple(names)) for panel, names in chosen.items()]


def picture_format(path: Path) -> str:
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in PICTURE_FORMATS:
        raise usage_error(
            f"invalid --out: {path} must end in {', '.join('.' + f for f in PICTURE_FORMATS)}"
        )
    return suffix


def draw_picture(
    runs: Sequence[RunCurves], panels: Sequence[tuple[str, tuple[str, ...]]], path: Path
) -> None:
    """One row of panels, every run in its own colour; written atomically, so a reader
    never sees half a picture (`ddpcli plot` on a run whose end writes curves.png)."""
    import matplotlib

    matplotlib.use("Agg")  # no display, no GUI toolkit: the same picture everywhere
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.6 * len(panels) + 0.4, 3.0), layout="constrained")
    row = fig.subplots(1, len(panels), squeeze=False)[0]
    for axes, (panel, names) in zip(row, panels, strict=True):
        for index, run in enumerate(runs):
            draw_run(axes, run, names, color=f"C{index % 10}", several=len(runs) > 1)
        axes.set_title(TITLES[panel], fontsize=10)
        axes.set_xlabel("step", fontsize=9)
        axes.tick_params(labelsize=8)
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7)
    fmt = picture_format(path)
    buffer = io.BytesIO()
    # Text stays text in an SVG: smaller, and searchable for run names.
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buffer, format=fmt, dpi=100)
    write_bytes_atomic(path, buffer.getvalue())


def draw_run(axes, run: RunCurves, names: tuple[str, ...], color: str, several: bool) -> None:
    for name in names:
        series = run.series[name]
        if not series.steps:
            continue
        kind = name.split("_")[0] if name in EPOCH_SERIES or name.startswith("train_") else name
        label = f"{run.label} {kind}" if several else kind
        if series.per_epoch:  # one point an epoch: markers, so that a single one shows
            axes.plot(series.steps, series.values, "o--", color=color, label=label, ms=4, lw=1)
        else:
            axes.plot(series.steps, series.values, "-", color=color, label=label, lw=1.2)


def draw_text(
    runs: Sequence[RunCurves],
    panels: Sequence[tuple[str, tuple[str, ...]]],
    width: int,
    color: bool,
) -> str:
    """The same panels as text, one chart under the other, for a terminal (COLOR: the
    terminal's own background, coloured lines; else plain text for a file or a pipe)."""
    import plotext

    charts = []
    for panel, names in panels:
        plotext.clear_figure()
        plotext.theme("clear")
        plotext.plotsize(width, 14)
        for run in runs:
            for name in names:
                series = run.series[name]
                if series.steps:
                    label = f"{run.label} {name}" if len(runs) > 1 else name
                    plotext.plot(series.steps, series.values, label=label, marker="braille")
        plotext.title(TITLES[panel])
        plotext.xlabel("step")
        chart = plotext.build()
        charts.append(chart if color else plotext.uncolorize(chart))
    plotext.clear_figure()
    return "\n".join(charts)


def write_run_curves(folder: Path) -> Path | None:
    """FOLDER/curves.png from what the run logged, for the end of `ddpcli train`; None when
    it logged nothing yet (a run stopped before its first interval)."""
    try:
        runs = [read_run(folder)]
    except DdpcliError:  # nothing logged: nothing to draw
        return None
    path = folder / CURVES_FILE
    draw_picture(runs, choose_panels(()), path)
    return path
