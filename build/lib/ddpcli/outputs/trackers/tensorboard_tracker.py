"""`--tracker tensorboard` (or `--tensorboard`): the rows of steps.jsonl and metrics.jsonl as
TensorBoard scalars under OUT/tensorboard. The `tensorboard` package is an optional extra:
`ddpcli.launcher.resolve` refuses the tracker (exit 2) before any worker starts when it is
missing.

TensorBoard's own tags (Lightning's names: `train/loss` per interval, `val/acc` per epoch)
stay as they were before the other trackers came. A resume tells it to hide what earlier
event files hold from the checkpoint's step on (`purge_step`): the steps it trains again.
"""

from __future__ import annotations

from typing import Any

from ddpcli.outputs.trackers.base import Ending, Opening, RowKind, Tracker, is_number

TENSORBOARD_DIR = "tensorboard"
FLUSH_S = 5  # a run that is still going (or was killed) shows its curves within seconds

# Row key -> TensorBoard tag: train/ per interval, val/ per epoch, as Lightning names them.
TAGS: dict[RowKind, dict[str, str]] = {
    "step": {
        "train_loss": "train/loss",
        "train_acc": "train/acc",
        "lr": "train/lr",
        "images_per_sec": "train/images_per_sec",
    },
    "epoch": {"val_loss": "val/loss", "val_acc": "val/acc", "train_loss": "epoch/train_loss"},
}


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self) -> None:
        self.writer: Any = None

    def start(self, opening: Opening) -> str | None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = opening.out / TENSORBOARD_DIR
        self.writer = SummaryWriter(
            log_dir=str(self.log_dir),
            flush_secs=FLUSH_S,
            purge_step=opening.resume_step + 1,
        )
        return None

    def where(self) -> str:
        return f"{self.log_dir} (tensorboard --logdir {self.log_dir})"

    def log_rows(self, rows: list[tuple[RowKind, dict[str, Any]]]) -> None:
        for kind, row in rows:
            if row.get("partial"):  # a stop inside the epoch: the resume's row replaces it
                continue
            for key, tag in TAGS[kind].items():
                if is_number(row.get(key)):
                    self.writer.add_scalar(tag, row[key], global_step=row["step"])

    def finish(self, ending: Ending) -> None:
        self.writer.close()
