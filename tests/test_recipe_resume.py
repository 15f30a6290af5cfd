"""Exact resume with every recipe ingredient on, at world size 2 on the CPU: a run stopped
inside an epoch and resumed ends with the same metrics (1e-6 relative) as one that never
stopped, on both data paths. Every draw (crops, policies, erasing, Mixup/CutMix, the
repeated-augmentation order) is a pure function of (seed, epoch, key, batch), and the
EMA weights travel in the checkpoint."""

from __future__ import annotations

import shutil

import pytest
from conftest import read_metrics, run_cli, settings_warnings

from ddpcli.checkpoint.loading import safe_load

EVERY_INGREDIENT = [
    "--cpu", "--nproc", "2", "--arch", "tinycnn", "--image-size", "16", "--synthetic-size", "128",
    "--per-gpu-batch", "16", "--epochs", "2", "--augment", "rrc", "--train-crop-size", "12",
    "--val-resize-size", "16", "--val-crop-size", "14", "--sync-bn", "--ema", "--ema-steps", "2",
    "--ema-decay", "0.99", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
    "--auto-augment", "ta_wide", "--random-erase", "0.25", "--ra-reps", "2",
    "--norm-weight-decay", "1e-5", "--label-smoothing", "0.1",
]  # fmt: skip
COMPARED = ("train_loss", "train_acc", "val_loss", "val_acc", "ema_val_loss", "ema_val_acc", "lr")


def train(out, *extra: str):
    result = run_cli("train", *EVERY_INGREDIENT, "--out", str(out), *extra, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def stopped_at(reference, out, step_checkpoint: str) -> None:
    """The folder a run stopped right after that step checkpoint leaves (its last.pt);
    one run fewer than stopping a third run for real (stopping is tested in test_loop_safety)."""
    (out / "checkpoints").mkdir(parents=True)
    source = reference / "checkpoints" / step_checkpoint
    shutil.copy(source, out / "checkpoints" / "last.pt")
    shutil.copy(source.with_name(source.name + ".sha256"), out / "checkpoints" / "last.pt.sha256")


@pytest.mark.parametrize(
    "path", [["--data-path", "device"], ["--data-path", "loader", "--workers", "0"]]
)
def test_every_ingredient_on_stopped_mid_epoch_resumes_to_the_same_metrics(tmp_path, path):
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    train(reference, *path, "--save-every-steps", "3", "--keep-last", "5")
    stopped_at(reference, resumed, "step-00000003.pt")  # batch 3 of 4 in epoch 1
    result = train(resumed, *path, "--resume", "auto")
    assert "at epoch 1, batch 3" in result.stderr and settings_warnings(result.stderr) == []
    want, got = read_metrics(reference), read_metrics(resumed)
    assert [m["epoch"] for m in got] == [1, 2]
    for mine, theirs in zip(got, want, strict=True):
        for key in COMPARED:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-12), (
                mine["epoch"],
                key,
            )
    assert "EMA val acc" in result.stderr  # both accuracies reported
    assert "recipe: sync-bn · EMA every 2 steps" in result.stderr  # what is on, said up front
    best = safe_load(reference / "checkpoints" / "best.pt")
    assert best["ema"] is not None and "n_averaged" in best["ema"]  # the EMA is checkpointed
    best_epoch = max(want, key=lambda m: m["ema_val_acc"])["epoch"]  # best.pt follows the EMA
    assert best["metrics"][-1]["epoch"] == best_epoch
