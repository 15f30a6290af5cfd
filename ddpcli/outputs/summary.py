"""What a training run reports back: rank 0's summary.json, as typed parts.

Each part has one writer: the loop (`Trainer.fit`) the last epoch's row, its step breakdown
and where the run stopped early (`StopRecord`, also what Ctrl-C and a termination leave
alone in summary.json); the worker the run's files, the images --skip-bad-images left out
and what each tracker holds; the launcher the curves it drew, or, on a node other than
node 0, which node finished. `to_dict` writes the summary.json every earlier version wrote
(same keys, same order, absent parts absent) and `from_dict` reads any of them back: a key
no part claims stays in the epoch row, where it came from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUMMARY_FILE = "summary.json"


@dataclass(frozen=True)
class StopRecord:
    """Where a run stopped before its end, and what a resume starts from. STOPPED:
    "interrupted" (Ctrl-C), "preempted" or "terminated" (SIGTERM that was not the
    preemption signal, named in PREEMPT_SIGNAL); STOPPED_EPOCH is 1-based."""

    stopped: str
    stopped_epoch: int
    stopped_step: int
    out: str
    last_checkpoint: str | None = None
    checkpoint_at: str | None = None  # where the saved checkpoint is, in the user's words
    preempt_signal: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> StopRecord:
        names = [part.name for part in dataclasses.fields(cls)]
        return cls(**{name: document[name] for name in names if name in document})


@dataclass(frozen=True)
class RunFiles:
    """What a finished run leaves in its folder, as absolute paths."""

    out: str
    metrics: str
    config: str
    last_checkpoint: str
    best_checkpoint: str

    @classmethod
    def in_folder(cls, out: Path) -> RunFiles:
        checkpoints = out / "checkpoints"
        return cls(
            out=str(out),
            metrics=str(out / "metrics.jsonl"),
            config=str(out / "config.json"),
            last_checkpoint=str(checkpoints / "last.pt"),
            best_checkpoint=str(checkpoints / "best.pt"),
        )


@dataclass(frozen=True)
class SkippedImages:
    """--skip-bad-images: how many files were left out; the first few and the file that
    lists them all, when there were any."""

    count: int
    first: list[str] | None = None
    listed_in: str | None = None

    def to_dict(self) -> dict[str, Any]:
        document: dict[str, Any] = {"skipped_images": self.count}
        if self.first is not None:
            document["skipped_images_first"] = self.first
        if self.listed_in is not None:
            document["skipped_images_file"] = self.listed_in
        return document

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> SkippedImages:
        return cls(
            document["skipped_images"],
            document.get("skipped_images_first"),
            document.get("skipped_images_file"),
        )


@dataclass(frozen=True)
class OtherNode:
    """A node other than node 0 finished: rank 0, on node 0, writes the outputs."""

    out: str
    node_rank: int


# The keys each part writes, which `from_dict` takes out of the epoch row.
_SKIPPED_KEYS = ("skipped_images", "skipped_images_first", "skipped_images_file")


@dataclass(frozen=True)
class RunSummary:
    """Rank 0's account of a run: finished, stopped early, or finished on another node."""

    last_epoch: dict[str, Any] = field(default_factory=dict)  # metrics.jsonl's last row
    step_breakdown: dict[str, Any] | None = None  # ddpcli.outputs.rankload.step_breakdown
    stop: StopRecord | None = None
    files: RunFiles | None = None
    other_node: OtherNode | None = None
    skipped: SkippedImages | None = None
    trackers: dict[str, Any] | None = None  # per tracker: its run id, rows not sent
    curves: str | None = None

    @property
    def out(self) -> str | None:
        part = self.files or self.stop or self.other_node
        return part.out if part is not None else None

    @property
    def last_checkpoint(self) -> str | None:
        """The finished run's files name it even where the stop record does not."""
        if self.files is not None:
            return self.files.last_checkpoint
        return self.stop.last_checkpoint if self.stop is not None else None

    @property
    def node_rank(self) -> int:
        return self.other_node.node_rank if self.other_node is not None else 0

    def to_dict(self) -> dict[str, Any]:
        """summary.json's object. The order is the one the parts were always merged in: a
        key two parts share (out, last_checkpoint) keeps the first one's place."""
        document = dict(self.last_epoch)
        if self.step_breakdown is not None:
            document["step_breakdown"] = self.step_breakdown
        if self.stop is not None:
            document.update(self.stop.to_dict())
        if self.files is not None:
            document.update(dataclasses.asdict(self.files))
        if self.other_node is not None:
            document.update(dataclasses.asdict(self.other_node))
        if self.skipped is not None:
            document.update(self.skipped.to_dict())
        if self.trackers is not None:
            document["trackers"] = self.trackers
        if self.curves is not None:
            document["curves"] = self.curves
        return document

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> RunSummary:
        """Any summary.json, this version's or an older one's."""
        claimed: set[str] = {"step_breakdown", "trackers", "curves"}
        files = other_node = stop = skipped = None
        file_keys = [part.name for part in dataclasses.fields(RunFiles)]
        if all(key in document for key in file_keys):
            files = RunFiles(**{key: document[key] for key in file_keys})
            claimed.update(file_keys)
        elif "node_rank" in document and "out" in document:
            other_node = OtherNode(document["out"], document["node_rank"])
            claimed.update(("out", "node_rank"))
        if "stopped" in document:
            stop = StopRecord.from_dict(_stop_part(document, files is not None))
            claimed.update(stop.to_dict())
        if "skipped_images" in document:
            skipped = SkippedImages.from_dict(document)
            claimed.update(_SKIPPED_KEYS)
        return cls(
            last_epoch={key: value for key, value in document.items() if key not in claimed},
            step_breakdown=document.get("step_breakdown"),
            stop=stop,
            files=files,
            other_node=other_node,
            skipped=skipped,
            trackers=document.get("trackers"),
            curves=document.get("curves"),
        )


def _stop_part(document: dict[str, Any], with_files: bool) -> dict[str, Any]:
    """The stop record's keys. Beside the run's files, last_checkpoint was the record's
    only where it comes before them (the record saved one); else it is the files'."""
    keys = list(document)
    if with_files and keys.index("last_checkpoint") > keys.index("metrics"):
        return {key: value for key, value in document.items() if key != "last_checkpoint"}
    return document
