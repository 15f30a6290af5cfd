"""`--tensorboard`: the rows of steps.jsonl and metrics.jsonl as TensorBoard scalars, under
OUT/tensorboard, written by rank 0. The `tensorboard` package is an optional extra:
`ddpcli.launcher.resolve` refuses the flag (exit 2) before any worker starts when it is missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

INSTALL_HINT = 'pip install "ddpcli[tensorboard]" (or pip install tensorboard)'
FLUSH_S = 5  # a run that is still going (or was killed) shows its curves within seconds

# Row key -> TensorBoard tag: train/ per interval, val/ per epoch, as Lightning names them.
STEP_TAGS = {
    "train_loss": "train/loss",
    "train_acc": "train/acc",
    "lr": "train/lr",
    "images_per_sec": "train/images_per_sec",
}
EPOCH_TAGS = {"val_loss": "val/loss", "val_acc": "val/acc", "train_loss": "epoch/train_loss"}


def tensorboard_installed() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardSink:
    def __init__(self, log_dir: Path, purge_step: int) -> None:
        """PURGE_STEP: TensorBoard hides what earlier event files hold from it on (the steps
        an interrupted run logged past the checkpoint this run resumes from)."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=FLUSH_S, purge_step=purge_step)

    def step_row(self, row: dict[str, Any]) -> None:
        self._scalars(STEP_TAGS, row)

    def epoch_row(self, metrics: dict[str, Any]) -> None:
        self._scalars(EPOCH_TAGS, metrics)

    def _scalars(self, tags: dict[str, str], row: dict[str, Any]) -> None:
        for key, tag in tags.items():
            value = row.get(key)
            if isinstance(value, (int, float)):
                self.writer.add_scalar(tag, value, global_step=row["step"])

    def close(self) -> None:
        self.writer.close()
