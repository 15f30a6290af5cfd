"""`--tracker wandb`: one Weights & Biases run per ddpcli run, continued by every resume (its
id is in the checkpoint). Without credentials (no WANDB_API_KEY, no login in ~/.netrc) it
runs offline, in OUT/wandb, and the run's end says the `wandb sync` command that uploads it.

W&B's history only grows, so the fan-out sends a row once a checkpoint holds its step. The
`wandb` package is an optional extra (`pip install "ddpcli[wandb]"`), imported here only
when a run starts.
"""

from __future__ import annotations

import secrets
import shlex
from pathlib import Path
from typing import Any

from ddpcli.outputs.trackers.base import Ending, Opening, RowKind, Tracker, metrics_of

INIT_TIMEOUT_S = 60  # online: how long wandb.init may wait for W&B's servers
EXIT_CODES = {"finished": 0, "stopped": 1, "failed": 1}


class WandbTracker(Tracker):
    name = "wandb"
    append_only = True

    def __init__(self) -> None:
        self.run: Any = None
        self.offline = False

    def start(self, opening: Opening) -> str | None:
        import wandb

        # The run's own lines say what W&B's would (its run, where, how to upload), and
        # W&B's terminal settings are taken from the first setup of the process, not from
        # init's: without this, every saved file is a "Symlinked 1 file" warning.
        wandb.setup(wandb.Settings(silent=True))
        self.offline = opening.wandb_offline
        run_id = opening.run_id or secrets.token_hex(4)  # W&B's own ids: 8 of [a-z0-9]
        self.run = wandb.init(
            project=opening.experiment,
            name=opening.run_name,
            id=run_id,
            resume="allow",
            dir=str(opening.out),
            mode="offline" if self.offline else "online",
            config=opening.params,
            tags=[f"{key}={value}"[:64] for key, value in opening.tags.items()],
            # Its console capture would wrap the run's own output, and its system sampling
            # costs a thread: the run's header and rank figures say those.
            settings=wandb.Settings(
                silent=True, init_timeout=INIT_TIMEOUT_S, console="off", x_disable_stats=True
            ),
        )
        self.run.config.update({"system": opening.tags}, allow_val_change=True)
        if self.offline:
            opening.notes.append(
                f"--tracker wandb ran offline (no W&B credentials); upload it with: "
                f"wandb sync {sync_folders(Path(self.run.settings.sync_dir), self.run.id)}"
            )
        return str(self.run.id)

    def where(self) -> str:
        if self.offline:
            return f"offline run {self.run.id} in {self.run.settings.sync_dir}"
        return f"run {self.run.id}: {self.run.url}"

    def log_rows(self, rows: list[tuple[RowKind, dict[str, Any]]]) -> None:
        for kind, row in rows:
            self.run.log(metrics_of(kind, row), step=int(row["step"]))

    def log_files(self, paths: list[Path]) -> None:
        for path in paths:
            self.run.save(str(path), base_path=str(path.parent), policy="now")

    def finish(self, ending: Ending) -> None:
        self.run.finish(exit_code=EXIT_CODES[ending])


def sync_folders(sync_dir: Path, run_id: str) -> str:
    """Every offline folder of the run, as a shell pattern: each start (the first, each
    resume) writes a folder of its own, `offline-run-TIME-ID`, and each holds only its own
    steps. The times sort as they ran, the order `wandb sync` uploads them in."""
    return f"{shlex.quote(str(sync_dir.parent))}/offline-run-*-{shlex.quote(run_id)}"
