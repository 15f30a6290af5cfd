"""`ddpcli plot`: the training curves of one or several run folders in one picture (and as
text in a terminal)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer

from ddpcli import ui
from ddpcli.cli.app import app, run_command
from ddpcli.cli.options import option
from ddpcli.errors import usage_error


@app.command(no_args_is_help=True)
def plot(
    runs: Annotated[
        list[Path],
        typer.Argument(
            help="Run folders (a train run's --out); several are overlaid, and one of them "
            "without metrics is skipped with a warning.",
            metavar="RUN_DIR...",
        ),
    ],
    out: Annotated[
        Path,
        option("Picture to write: .png, .svg or .pdf.", default="curves.png", metavar="FILE"),
    ] = Path("curves.png"),
    metric: Annotated[
        list[str] | None,
        option(
            "What to draw, once per panel: loss, acc, lr, images_per_sec, or one series "
            "(train_loss, val_loss, train_acc, val_acc).",
            default="loss, acc, lr",
            metavar="NAME",
        ),
    ] = None,
    text: Annotated[
        bool | None,
        option(
            "Also draw the curves as text on stdout.",
            default="when stdout is a terminal",
            decls=("--text/--no-text",),
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print what was drawn as JSON.")
    ] = False,
) -> None:
    """Draw the training curves of one or several runs.

    Train values come per logging interval (steps.jsonl), validation per epoch
    (metrics.jsonl); a run that is still going is drawn up to its last row."""

    def action() -> None:
        from ddpcli.outputs.curves import (
            choose_panels,
            draw_picture,
            draw_text,
            picture_format,
            read_runs,
        )

        picture_format(out)
        panels = choose_panels(metric or ())
        curves, skipped = read_runs(runs)
        for missing in skipped:
            ui.warn(f"skipped {missing.folder}: it {missing.reason}")
        try:
            draw_picture(curves, panels, out)
        except OSError as error:
            raise usage_error(f"invalid --out: cannot write {out} ({error.strerror})") from None
        if json_output:
            ui.print_json({
                "picture": str(out),
                "panels": [panel for panel, _ in panels],
                "runs": [
                    {"name": run.label, "folder": str(run.folder), "last_step": run.last_step}
                    for run in curves
                ],
                "skipped": [
                    {"folder": str(missing.folder), "reason": missing.reason} for missing in skipped
                ],
            })  # fmt: skip
            return
        terminal = sys.stdout.isatty()
        if text or (text is None and terminal):
            width = min(shutil.get_terminal_size().columns, 120)
            sys.stdout.write(draw_text(curves, panels, width, color=terminal) + "\n")
        steps = ", ".join(f"{run.label} to step {run.last_step}" for run in curves)
        ui.info(f"curves of {steps}: {out}")

    run_command(action)
