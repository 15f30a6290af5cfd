"""`ddpcli train` end to end: real Gloo processes, real files."""

import json
import sys

import pytest
from conftest import LiveProcess, clean_env, ctrl_c_after, read_metrics, run_bounded, run_cli

TINY = ["--cpu", "--arch", "tinycnn", "--image-size", "16", "--per-gpu-batch", "32"]


def test_two_gloo_workers_learn_the_synthetic_set(tmp_path):
    out = tmp_path / "run"
    # --lr 0.8 per 256 images is 0.2 at this global batch of 64.
    result = run_cli(
        "train", *TINY, "--nproc", "2", "--synthetic-size", "2048", "--epochs", "4",
        "--lr", "0.8", "--out", str(out), "--json", timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)  # stdout holds the JSON document and nothing else
    assert summary["world_size"] == 2
    assert summary["global_batch"] == 64
    assert summary["val_acc"] > 0.5  # chance is 0.1
    metrics = read_metrics(out)
    assert [m["epoch"] for m in metrics] == [1, 2, 3, 4]
    for field in ("train_loss", "val_loss", "val_acc", "images_per_sec", "global_batch"):
        assert all(field in m for m in metrics)
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"]
    assert all(m["images_per_sec"] > 0 for m in metrics)
    config = json.loads((out / "config.json").read_text())
    assert config["arch"] == "tinycnn" and config["backend"] == "gloo"
    assert (out / "checkpoints" / "last.pt").is_file()
    assert (out / "checkpoints" / "best.pt").is_file()
    # The run states the batch arithmetic before the first step.
    assert "global batch 64" in result.stderr
    assert "world size 2" in result.stderr
    # ... and the learning rate it scaled to that batch, which config.json records.
    assert "lr 0.8 per 256 images -> 0.2 at global batch 64 (linear)" in result.stderr
    assert config["lr"] == 0.8 and config["peak_lr"] == 0.2
    assert all(m["peak_lr"] == 0.2 for m in metrics)


@pytest.fixture(scope="module")
def accumulated_run(tmp_path_factory):
    """One epoch into a new folder with --resume auto, an odd validation count and
    --accumulate 2, checked by the three tests below: synthetic-size 84 -> 21 validation
    images; 84 training images over 2 ranks in micro-batches of 3 -> 14 micro-batches a
    rank, 2 a step -> 7 steps."""
    out = tmp_path_factory.mktemp("accumulated") / "run"
    result = run_cli(
        "train", *TINY, "--nproc", "2", "--synthetic-size", "84", "--epochs", "1",
        "--per-gpu-batch", "3", "--accumulate", "2", "--resume", "auto", "--out", str(out),
        timeout=180,
    )  # fmt: skip
    return out, result


def test_validation_counts_every_sample_once_with_an_odd_count(accumulated_run):
    # 21 validation images: odd, so a padded sampler would count 22.
    out, result = accumulated_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_metrics(out)[0]["val_samples"] == 21


def test_max_steps_stops_early_and_plain_progress_lines(tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train", *TINY, "--nproc", "2", "--synthetic-size", "2048", "--epochs", "3",
        "--max-steps", "4", "--log-every", "2", "--out", str(out), timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out)
    assert len(metrics) == 1 and metrics[0]["step"] == 4
    assert "step 2/" in result.stderr and "step 4/" in result.stderr  # one line per interval
    assert "outputs in" in result.stderr


def test_accumulation_multiplies_the_global_batch(accumulated_run):
    out, result = accumulated_run
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out)[0]
    assert metrics["global_batch"] == 3 * 2 * 2
    assert metrics["step"] == 7  # 42 images per rank / 3 = 14 micro-batches = 7 steps


def test_under_torchrun_each_process_is_one_worker(tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "ddpcli", "train", *TINY, "--synthetic-size", "256",
        "--epochs", "1", "--out", str(out),
    ]  # fmt: skip
    result = run_bounded(command, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(out)
    assert len(metrics) == 1  # one world of 2, not two worlds of 2
    assert metrics[0]["world_size"] == 2


def test_ctrl_c_under_torchrun_is_said_once_for_the_job(tmp_path):
    """Under torchrun every rank is a `ddpcli train` of its own; only rank 0 says where the
    run stopped (the others would repeat its line)."""
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "ddpcli", "train", *TINY, "--synthetic-size", "8192", "--log-every", "2",
        "--epochs", "1", "--out", str(out),
    ]  # fmt: skip
    run = LiveProcess(command, clean_env())
    ctrl_c_after(run, "step 4/")
    assert run.stderr.count("interrupted at epoch 1 step") == 1, run.stderr[-3000:]


def test_resume_auto_without_checkpoint_starts_fresh(accumulated_run):
    out, result = accumulated_run  # --resume auto into a new folder
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting fresh" in result.stderr
    assert len(read_metrics(out)) == 1
