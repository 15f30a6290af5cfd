"""The typed summary (ddpcli.outputs.summary) writes the summary.json earlier versions wrote,
key for key and in the same order, and reads any of them back."""

from __future__ import annotations

import json
from pathlib import Path

from ddpcli import ui
from ddpcli.outputs.summary import (
    OtherNode,
    RunFiles,
    RunSummary,
    SkippedImages,
    StopRecord,
)
from ddpcli.training.stopping import stop_record

EPOCH = {"epoch": 2, "step": 64, "train_loss": 0.9, "val_acc": 0.89, "images_per_sec": 1042.9}
BREAKDOWN = {"per_rank": [], "slowest_rank": 0, "steps": 29, "clock": "host"}


def finished(out: Path) -> dict:
    """What the worker wrote before the summary was typed, for a finished run."""
    return {
        **EPOCH,
        "step_breakdown": BREAKDOWN,
        "out": str(out),
        "metrics": str(out / "metrics.jsonl"),
        "config": str(out / "config.json"),
        "last_checkpoint": str(out / "checkpoints" / "last.pt"),
        "best_checkpoint": str(out / "checkpoints" / "best.pt"),
        "skipped_images": 3,
        "skipped_images_first": ["a.jpg", "b.jpg", "c.jpg"],
        "skipped_images_file": str(out / "skipped_images.txt"),
        "trackers": {"csv": {}},
    }


def test_a_finished_run_writes_the_same_summary_json(tmp_path):
    summary = RunSummary(
        last_epoch=dict(EPOCH),
        step_breakdown=BREAKDOWN,
        files=RunFiles.in_folder(tmp_path),
        skipped=SkippedImages(3, ["a.jpg", "b.jpg", "c.jpg"], str(tmp_path / "skipped_images.txt")),
        trackers={"csv": {}},
    )
    written = ui.json_text(summary.to_dict(), indent=2)
    assert written == ui.json_text(finished(tmp_path), indent=2)
    assert RunSummary.from_dict(json.loads(written)) == summary


def test_a_preempted_run_keeps_the_stop_records_keys_in_their_place(tmp_path):
    record = StopRecord(
        "preempted", 2, 40, str(tmp_path), str(tmp_path / "checkpoints" / "last.pt"), "step 40"
    )
    summary = RunSummary(last_epoch=dict(EPOCH), stop=record, files=RunFiles.in_folder(tmp_path))
    before = {**EPOCH, **record.to_dict()}
    before.update(dataclass_files(tmp_path))
    assert list(summary.to_dict().items()) == list(before.items())
    assert RunSummary.from_dict(before) == summary
    assert summary.last_checkpoint == str(tmp_path / "checkpoints" / "last.pt")


def test_a_stop_without_a_checkpoint_reads_back_where_it_was(tmp_path):
    record = StopRecord("preempted", 1, 3, str(tmp_path))
    before = {**EPOCH, **record.to_dict(), **dataclass_files(tmp_path)}
    summary = RunSummary.from_dict(before)
    assert summary.stop == record
    assert list(summary.to_dict()) == list(before)


def dataclass_files(out: Path) -> dict:
    return {
        "out": str(out),
        "metrics": str(out / "metrics.jsonl"),
        "config": str(out / "config.json"),
        "last_checkpoint": str(out / "checkpoints" / "last.pt"),
        "best_checkpoint": str(out / "checkpoints" / "best.pt"),
    }


def test_the_stop_record_names_what_a_resume_starts_from(tmp_path):
    record = stop_record("terminated", 2, 12, 10, 5, tmp_path, "SIGUSR1")
    assert record.to_dict() == {
        "stopped": "terminated",
        "stopped_epoch": 2,
        "stopped_step": 12,
        "out": str(tmp_path),
        "last_checkpoint": str(tmp_path / "checkpoints" / "last.pt"),
        "checkpoint_at": "epoch 2",
        "preempt_signal": "SIGUSR1",
    }
    unsaved = stop_record("interrupted", 1, 2, None, 5, tmp_path)
    assert unsaved.to_dict() == {
        "stopped": "interrupted",
        "stopped_epoch": 1,
        "stopped_step": 2,
        "out": str(tmp_path),
    }
    assert RunSummary.from_dict(unsaved.to_dict()) == RunSummary(stop=unsaved)


def test_another_nodes_summary_and_the_launchers_curves():
    document = {"out": "/runs/a", "node_rank": 1}
    summary = RunSummary.from_dict(document)
    assert summary.other_node == OtherNode("/runs/a", 1)
    assert (summary.node_rank, summary.out, summary.last_epoch) == (1, "/runs/a", {})
    assert summary.to_dict() == document
    drawn = {**finished(Path("/runs/b")), "curves": "/runs/b/curves.png"}
    assert RunSummary.from_dict(drawn).curves == "/runs/b/curves.png"
    assert list(RunSummary.from_dict(drawn).to_dict().items()) == list(drawn.items())


def test_an_old_summary_with_keys_no_part_claims_reads_back_whole():
    old = {"epoch": 1, "val_acc": 0.5, "gone_figure": 7, "out": "/runs/old"}
    summary = RunSummary.from_dict(old)
    assert summary.last_epoch == old  # no part is complete: every key stays in the row
    assert summary.to_dict() == old


def test_the_baselines_summary_json_reads_back_byte_for_byte():
    baseline = Path(__file__).parent / "fixtures" / "summary_finished.json"
    text = baseline.read_text()
    summary = RunSummary.from_dict(json.loads(text))
    assert summary.files is not None and summary.step_breakdown is not None
    assert ui.json_text(summary.to_dict(), indent=2) + "\n" == text
