"""The run's checkpoints on disk: written by rank 0 only, guarded by barriers, the newest
`--keep-last` kept, `last.pt` and `best.pt` pointing at the newest and the best."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from ddpcli import ui
from ddpcli.config.plan import RunPlan
from ddpcli.dist import DistContext, barrier
from ddpcli.errors import DdpcliError, runtime_error
from ddpcli.files import atomic_save, link_or_copy_atomic, sha256_path, write_text_atomic


class CheckpointWriter:
    """Saves `name` (an epoch or step checkpoint), points last.pt (and best.pt) at it, and
    keeps only the newest `keep_last` epoch/step files. Only rank 0 touches the disk; the
    barrier after it means no rank can read or overwrite a file that is half written."""

    def __init__(self, cfg: RunPlan, ctx: DistContext) -> None:
        self.directory = cfg.out / "checkpoints"
        self.keep_last = cfg.keep_last
        self.ctx = ctx

    def save(self, payload: dict[str, Any], name: str, is_best: bool) -> None:
        if self.ctx.is_main:
            try:
                self.write(payload, name, is_best)
            except OSError as error:  # every write is atomic: the files there stay as they were
                raise save_failed(self.directory, error) from None
        barrier(self.ctx)

    def write(self, payload: dict[str, Any], name: str, is_best: bool) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.keep_last == 0:
            atomic_save(payload, self.directory / "last.pt")
            if is_best:
                link_or_copy_atomic(self.directory / "last.pt", self.directory / "best.pt")
        else:
            atomic_save(payload, self.directory / name)
            link_or_copy_atomic(self.directory / name, self.directory / "last.pt")
            if is_best:
                link_or_copy_atomic(self.directory / name, self.directory / "best.pt")
            self.prune()
        self.remove_stale_temporaries()

    def prune(self) -> None:
        numbered = [*self.directory.glob("epoch-*.pt"), *self.directory.glob("step-*.pt")]
        numbered.sort(key=lambda p: (p.stat().st_mtime_ns, p.name))
        for old in numbered[: max(0, len(numbered) - self.keep_last)]:
            old.unlink(missing_ok=True)
            sha256_path(old).unlink(missing_ok=True)

    def remove_stale_temporaries(self) -> None:
        """A save killed mid-write leaves its temporary file; the next save sweeps it."""
        for stale in self.directory.glob(".*.tmp"):
            stale.unlink(missing_ok=True)


def save_failed(directory: Path, error: OSError) -> DdpcliError:
    """A run-time failure in one line: what the system said, where, and what to do."""
    reason = error.strerror or str(error)
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "free space there, then resume with --resume auto"
    else:
        hint = "check that folder's permissions and mount, then resume with --resume auto"
    return runtime_error(
        f"could not save a checkpoint in {directory}: {reason}; {hint} (the checkpoints "
        "already there are intact)"
    )


def write_metrics_history(path: Path, history: list[dict[str, Any]]) -> None:
    """metrics.jsonl from the checkpoint's history: after a resume each epoch is there exactly
    once, even if the interrupted run had appended an epoch its last checkpoint never saw."""
    write_text_atomic(Path(path), "".join(ui.json_text(metrics) + "\n" for metrics in history))
