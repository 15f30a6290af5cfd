"""`ddpcli train`'s Outputs and checkpoints panel: the run folder, its checkpoints and logs,
and how a run stops to be resumed."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from ddpcli.cli.train_options import train_option

PANEL = "Outputs and checkpoints"

Out = Annotated[Path | None, train_option("out", "Output folder.", PANEL, default="runs/<time>")]

Resume = Annotated[
    str | None,
    train_option(
        "resume",
        "PATH or auto (OUT/checkpoints/last.pt).",
        PANEL,
        default="none: a fresh start",
    ),
]

Overwrite = Annotated[
    bool | None,
    train_option(
        "overwrite",
        "Clear an earlier run's metrics and checkpoints from --out first.",
        PANEL,
    ),
]

SaveEverySteps = Annotated[
    int | None,
    train_option(
        "save_every_steps",
        "Also checkpoint every N steps.",
        PANEL,
        default="at epoch ends only",
    ),
]

KeepLast = Annotated[
    int | None, train_option("keep_last", "Epoch/step checkpoints to keep.", PANEL)
]

LogDir = Annotated[
    Path | None,
    train_option("log_dir", "One log file per rank.", PANEL, default="none: the terminal"),
]

LogEvery = Annotated[int | None, train_option("log_every", panel=PANEL)]

Tensorboard = Annotated[bool | None, train_option("tensorboard", panel=PANEL)]

PreemptSignal = Annotated[
    str | None,
    train_option(
        "preempt_signal",
        "A scheduler's warning (SLURM: --signal=USR1@90), sent to the launcher or any "
        "rank: all ranks save a checkpoint within --log-every steps and stop (exit 1).",
        PANEL,
    ),
]
