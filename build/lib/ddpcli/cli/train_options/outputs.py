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

ProfileSteps = Annotated[
    str | None,
    train_option(
        "profile_steps",
        "One torch.profiler trace per rank, of the steps after step A up to step B, in "
        "OUT/profile/ (Perfetto UI, Holistic Trace Analysis).",
        PANEL,
        default="off",
        metavar="A:B",
    ),
]

Tensorboard = Annotated[bool | None, train_option("tensorboard", panel=PANEL)]

Tracker = Annotated[
    str | None,
    train_option(
        "tracker",
        "Experiment trackers fed by rank 0 (a comma list); MLflow and W&B are extras.",
        PANEL,
        default="none",
        metavar="csv,mlflow,wandb,tensorboard",
    ),
]

TrackingUri = Annotated[
    str | None,
    train_option(
        "tracking_uri",
        "MLflow's tracking server or store.",
        PANEL,
        default="MLFLOW_TRACKING_URI, else OUT/mlflow.db",
    ),
]

Experiment = Annotated[
    str | None,
    train_option(
        "experiment", "The trackers' experiment (W&B: project).", PANEL,
        default="the recipe's name, else ARCH-DATASET",
    ),
]  # fmt: skip

RunName = Annotated[
    str | None,
    train_option("run_name", "The trackers' run name.", PANEL, default="the --out folder's name"),
]

TrackerStrict = Annotated[bool | None, train_option("tracker_strict", panel=PANEL)]

TrackerCheckpoints = Annotated[bool | None, train_option("tracker_checkpoints", panel=PANEL)]

PreemptSignal = Annotated[
    str | None,
    train_option(
        "preempt_signal",
        "A scheduler's warning (SLURM: --signal=USR1@90), sent to the launcher or any "
        "rank: all ranks save a checkpoint within --log-every steps and stop (exit 1).",
        PANEL,
    ),
]
