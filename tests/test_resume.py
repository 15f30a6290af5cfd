"""Exact resume at world size 2 on the CPU: the same losses, the same samples.

One uninterrupted reference run keeps every epoch and step checkpoint and records, through
DDPCLI_TRACE_SAMPLES, the sample indices each rank trained on. Each test then resumes from
one of those checkpoints, exactly what a run killed right after writing it would leave, and
compares losses (1e-6 relative) and the samples seen with the reference.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, run_cli, settings_warnings, traced_records

from ddpcli.checkpoint.loading import safe_load

SAMPLES = 256
PER_GPU_BATCH = 16
WORLD_SIZE = 2
BATCHES_PER_EPOCH = SAMPLES // WORLD_SIZE // PER_GPU_BATCH  # 8
SETTINGS = [
    "--cpu", "--arch", "tinycnn", "--image-size", "16", "--synthetic-size", str(SAMPLES),
    "--per-gpu-batch", str(PER_GPU_BATCH), "--epochs", "3", "--save-every-steps", "3",
    "--keep-last", "20",
]  # fmt: skip
COMPARED = ("train_loss", "train_acc", "val_loss", "val_acc", "lr")  # lr: the scheduler


def train(out: Path, *extra: str, trace: Path | None = None, nproc: int = WORLD_SIZE):
    env = {"DDPCLI_TRACE_SAMPLES": str(trace)} if trace else None
    args = ["train", *SETTINGS, "--nproc", str(nproc), "--out", str(out), *extra]
    result = run_cli(*args, env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def read_trace(trace: Path, rank: int) -> list[tuple[int, list[int]]]:
    return [(record["epoch"], record["indices"]) for record in traced_records(trace, rank)]


def assert_same_results(resumed: list[dict], reference: list[dict]) -> None:
    assert [m["epoch"] for m in resumed] == [1, 2, 3]  # each epoch exactly once
    for got, want in zip(resumed, reference, strict=True):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-12), (got["epoch"], key)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """The uninterrupted run; `--resume auto` with no checkpoint yet must start fresh."""
    base = tmp_path_factory.mktemp("reference")
    out, trace = base / "run", base / "trace"
    result = train(out, "--resume", "auto", trace=trace)
    assert "starting fresh" in result.stderr
    return out, trace


def test_every_sample_is_trained_once_per_epoch(reference):
    _, trace = reference
    per_rank = [read_trace(trace, rank) for rank in range(WORLD_SIZE)]
    for epoch in range(3):
        seen = [i for records in per_rank for e, batch in records if e == epoch for i in batch]
        assert sorted(seen) == list(range(SAMPLES))
    first_epoch = [batch for e, batch in per_rank[0] if e == 0]
    second_epoch = [batch for e, batch in per_rank[0] if e == 1]
    assert first_epoch != second_epoch  # set_epoch reshuffles


def test_resume_after_an_epoch_matches_the_uninterrupted_run(reference, tmp_path):
    ref_out, ref_trace = reference
    out, trace = tmp_path / "run", tmp_path / "trace"
    checkpoint = ref_out / "checkpoints" / "epoch-0001.pt"
    result = train(out, "--resume", str(checkpoint), trace=trace)
    assert "at epoch 2" in result.stderr and settings_warnings(result.stderr) == []
    # metrics.jsonl of the new folder starts with the checkpoint's history.
    assert_same_results(read_metrics(out), read_metrics(ref_out))
    for rank in range(WORLD_SIZE):
        before = read_trace(ref_trace, rank)[:BATCHES_PER_EPOCH]
        assert before + read_trace(trace, rank) == read_trace(ref_trace, rank)


def kill_after(ref_out: Path, out: Path, step_checkpoint: str, epochs_logged: int) -> dict:
    """The folder a run killed mid-epoch leaves: last.pt is a step checkpoint, and
    metrics.jsonl may already hold an epoch that no checkpoint saw finish."""
    (out / "checkpoints").mkdir(parents=True)
    source = ref_out / "checkpoints" / step_checkpoint
    shutil.copy(source, out / "checkpoints" / "last.pt")
    shutil.copy(source.with_name(source.name + ".sha256"), out / "checkpoints" / "last.pt.sha256")
    lines = (ref_out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:epochs_logged]))
    return safe_load(out / "checkpoints" / "last.pt", check_digest=True)


def test_mid_epoch_resume_skips_exactly_the_batches_already_trained(reference, tmp_path):
    ref_out, ref_trace = reference
    out, trace = tmp_path / "run", tmp_path / "trace"
    # Step 15 is batch 7 of 8 in the second epoch; the kill came after epoch 2 was logged.
    payload = kill_after(ref_out, out, "step-00000015.pt", epochs_logged=2)
    assert (payload["epoch"], payload["batch_in_epoch"], payload["step"]) == (1, 7, 15)
    assert len(payload["rng"]) == WORLD_SIZE and payload["partial_sums"][2] == 7 * 32
    result = train(out, "--resume", "auto", trace=trace)
    assert "at epoch 2, batch 7" in result.stderr
    # The partial loss sums came back: epoch 2's train_loss equals the uninterrupted one.
    assert_same_results(read_metrics(out), read_metrics(ref_out))
    trained_before = BATCHES_PER_EPOCH + 7
    for rank in range(WORLD_SIZE):
        resumed = read_trace(trace, rank)
        assert resumed[0] == (1, read_trace(ref_trace, rank)[trained_before][1])
        assert read_trace(ref_trace, rank)[:trained_before] + resumed == read_trace(ref_trace, rank)
    final = safe_load(out / "checkpoints" / "last.pt", check_digest=True)
    reference_final = safe_load(ref_out / "checkpoints" / "last.pt")
    for key, tensor in final["model"].items():
        assert torch.allclose(tensor, reference_final["model"][key], rtol=1e-5, atol=1e-7), key


def test_a_smaller_world_keeps_the_global_batch_and_a_gpu_checkpoint_loads_on_cpu(
    reference, tmp_path, monkeypatch
):
    import torch.serialization

    ref_out, _ = reference
    payload = safe_load(ref_out / "checkpoints" / "epoch-0001.pt")
    from_gpu = tmp_path / "from-gpu.pt"
    with monkeypatch.context() as patch:  # the bytes a save on cuda:0 writes
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(payload, from_gpu)
    out = tmp_path / "run"
    result = train(out, "--resume", str(from_gpu), nproc=1)
    # tinycnn's --lr 0.2 per 256 images: 0.025 at a global batch of 32, 0.0125 at 16; one
    # rank of 16 cannot hold 32 without --accumulate 2, and so keeps it.
    assert "world 2 -> 1: global batch 32 -> 32 (kept), accumulate 1 -> 2" in result.stderr
    assert "peak lr 0.025 -> 0.025" in result.stderr and "settings differ" not in result.stderr
    metrics = read_metrics(out)
    assert [m["epoch"] for m in metrics] == [1, 2, 3]
    assert [m["world_size"] for m in metrics] == [2, 1, 1]
    assert [m["global_batch"] for m in metrics] == [32, 32, 32]
    assert [m["peak_lr"] for m in metrics] == [0.025, 0.025, 0.025]
