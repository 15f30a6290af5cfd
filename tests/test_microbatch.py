"""--per-gpu-batch auto (issue 50): each process's share of the global batch run in the
largest micro-batch that fits, and a step that runs out of memory run again smaller on every
rank together, the global batch, sample order and epoch kept. On the CPU the faults are made
with DDPCLI_FAKE_OOM=RANK:PHASE:BATCH[:STEP]; the model has no batch norm, so a run split
one way and a run split another train alike up to rounding."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from conftest import REPO, read_metrics, run_cli, traced_counts

from ddpcli.checkpoint.loading import safe_load
from ddpcli.training.microbatch import micro_batch_sizes, next_lower

MODEL = f"{REPO / 'tests' / 'fixtures' / 'models' / 'nobn.py'}:make"
SIZE = 384  # 4 steps of a global batch of 96: a share of 32 on each of 3 ranks
RUN = [
    "train", "--cpu", "--arch", MODEL, "--per-gpu-batch", "auto", "--image-size", "16",
    "--synthetic-size", str(SIZE), "--epochs", "1", "--workers", "0", "--log-every", "1",
    "--timeout", "60",
]  # fmt: skip
FIGURES = ("train_loss", "train_acc", "val_loss", "val_acc")


def trained(tmp_path: Path, name: str, faults: str, *extra: str, nproc: int = 3, code: int = 0):
    out, trace = tmp_path / name, tmp_path / f"{name}.trace"
    world = ["--nproc", str(nproc), "--global-batch", str(32 * nproc)]
    env = {"DDPCLI_FAKE_OOM": faults, "DDPCLI_TRACE_SAMPLES": str(trace)}
    result = run_cli(*RUN, *world, "--out", str(out), *extra, env=env, timeout=180)
    assert result.returncode == code, result.stderr[-3000:]
    return out, trace, result.stderr


def lowered_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "out of memory in the" in line]


def assert_each_sample_once(trace: Path, nproc: int) -> None:
    counts = traced_counts(trace, nproc)
    assert sorted(counts) == list(range(SIZE)) and set(counts.values()) == {1}, counts


def assert_same_figures(out: Path, reference: Path) -> None:
    ours, theirs = read_metrics(out)[-1], read_metrics(reference)[-1]
    for name in FIGURES:
        assert math.isclose(ours[name], theirs[name], rel_tol=1e-6, abs_tol=1e-9), (
            name, ours, theirs,
        )  # fmt: skip


@pytest.fixture(scope="module")
def started_at(tmp_path_factory):
    """Runs whose search found 16 (or 11) from the start, on 3 ranks: what a run that
    lowered its micro-batch mid-run must match."""
    folder = tmp_path_factory.mktemp("reference")
    return {
        16: trained(folder, "at16", "0:forward:17")[0],
        11: trained(folder, "at11", "0:forward:12")[0],
    }


# --- the arithmetic


def test_micro_batches_split_a_share_evenly_and_lower_finer_than_halving():
    assert micro_batch_sizes(32, 32) == [32]
    assert micro_batch_sizes(32, 11) == [11, 11, 10]
    assert micro_batch_sizes(64, 22) == [22, 21, 21]
    lowered, size = [], 64
    while size:
        size = next_lower(64, size)
        lowered.append(size)
    assert lowered[:6] == [32, 22, 16, 13, 11, 10] and lowered[-3:] == [2, 1, 0]
    assert lowered == sorted(lowered, reverse=True) and len(set(lowered)) == len(lowered)


# --- the search


def test_the_search_keeps_the_largest_micro_batch_every_rank_can_run(started_at):
    config = (started_at[16] / "config.json").read_text()
    assert '"batch_auto": true' in config and '"per_gpu_batch": 32' in config
    payload = safe_load(started_at[11] / "checkpoints" / "last.pt")
    assert payload["micro_batch"] == 11 and payload["micro_batch_on"] == "3 x cpu"


def test_the_header_says_what_ran_out_and_what_the_search_kept(tmp_path):
    _, trace, stderr = trained(tmp_path, "run", "2:backward:17,1:forward:12")
    said = next(line for line in stderr.splitlines() if line.startswith("per-GPU batch"))
    assert said == (
        "per-GPU batch 32 in 3 micro-batches of 11 or 10 (auto: 16 ran out of memory on rank 1;"
        " 11 ran) × world 3 = global batch 96"
    ), said
    assert_each_sample_once(trace, 3)


def test_on_the_cpu_auto_keeps_the_batch_and_says_why(tmp_path):
    out = tmp_path / "run"
    result = run_cli(*RUN, "--nproc", "2", "--out", str(out), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "per-GPU batch 64 (auto on the CPU: running out of memory there is the kernel's OOM "
        "killer, which no rank survives, so the batch is kept as planned) × accumulate 1 × "
        "world 2 = global batch 128"
    ) in result.stderr
    assert read_metrics(out)[-1]["global_batch"] == 128


def test_a_micro_batch_of_1_that_does_not_fit_ends_the_run_before_its_first_step(tmp_path):
    out, _, stderr = trained(tmp_path, "run", "1:step:1", nproc=2, code=1)
    assert (
        "rank 1 runs out of memory in its step even at a micro-batch of 1; the model does "
        "not fit that device"
    ) in stderr, stderr[-2000:]
    assert "Traceback" not in stderr
    assert not (out / "metrics.jsonl").exists() or not read_metrics(out)


# --- a step out of memory mid-run


@pytest.mark.parametrize(
    ("faults", "kept", "phase"),
    [
        ("1:forward:32:2", 16, "the forward pass on rank(s) 1"),
        ("2:backward:32:2", 16, "the backward pass on rank(s) 2"),
        (
            "0:forward:32:2,1:forward:32:2,2:backward:32:2",
            16,
            "the forward pass on rank(s) 0, 1 and the backward pass on rank(s) 2",
        ),
        ("1:forward:16:2", 11, "the forward pass on rank(s) 1"),  # 32, then 16: twice in a row
    ],
    ids=["forward-one-rank", "backward-one-rank", "every-rank", "twice-in-a-row"],
)
def test_a_step_out_of_memory_runs_again_smaller_on_every_rank(
    tmp_path, started_at, faults, kept, phase
):
    out, trace, stderr = trained(tmp_path, "run", faults)
    said = lowered_lines(stderr)
    assert said[-1] == (
        f"warning: step 3: out of memory in {phase}; the step runs again in micro-batches of "
        f"{kept} (the global batch, learning rate and sample order are kept)"
    ), said
    assert len(said) == (2 if kept == 11 else 1), said
    assert_each_sample_once(trace, 3)
    metrics = read_metrics(out)[-1]
    assert metrics["step"] == 4 and metrics["global_batch"] == 96
    assert_same_figures(out, started_at[kept])
    assert safe_load(out / "checkpoints" / "last.pt")["micro_batch"] == kept


def test_a_backward_pass_cut_short_after_some_buckets_started_is_run_again(tmp_path, started_at):
    """Buckets of 1 kB: each parameter's all-reduce starts as its gradient comes, and rank 2
    runs out of memory halfway through its last backward pass; it starts the buckets it had
    not, so no rank waits in one, and the step runs again."""
    faults, buckets = "2:backward:32:2", ["--bucket-cap-mb", "0.001"]
    out, trace, stderr = trained(tmp_path, "run", faults, *buckets)
    assert lowered_lines(stderr) == [
        "warning: step 3: out of memory in the backward pass on rank(s) 2; the step runs again "
        "in micro-batches of 16 (the global batch, learning rate and sample order are kept)"
    ], stderr[-2000:]
    assert_each_sample_once(trace, 3)
    assert_same_figures(out, started_at[16])


def test_on_2_ranks_a_step_out_of_memory_runs_again_and_matches_a_run_started_smaller(
    tmp_path,
):
    reference, _, _ = trained(tmp_path, "at16", "0:forward:17", nproc=2)
    out, trace, stderr = trained(
        tmp_path, "run", "1:backward:32:2", "--bucket-cap-mb", "0.001", nproc=2
    )
    assert len(lowered_lines(stderr)) == 1, stderr[-2000:]
    counts = traced_counts(trace, 2)
    assert sorted(counts) == list(range(SIZE - SIZE % 64)) and set(counts.values()) == {1}
    assert_same_figures(out, reference)


def test_an_optimizer_step_out_of_memory_is_retried_on_its_rank_and_lowers_the_rest(
    tmp_path, started_at
):
    out, trace, stderr = trained(tmp_path, "run", "1:step:32:2")
    assert lowered_lines(stderr) == [
        "warning: step 3: out of memory in the optimizer step on rank(s) 1; its step was "
        "retried there, and every rank now runs micro-batches of 16 (the global batch, "
        "learning rate and sample order are kept)"
    ], stderr[-2000:]
    assert_each_sample_once(trace, 3)
    assert_same_figures(out, started_at[16])


def test_a_step_out_of_memory_right_before_a_save_is_saved_lowered(tmp_path, started_at):
    out, trace, _ = trained(tmp_path, "run", "1:backward:32:1", "--save-every-steps", "2")
    saved = safe_load(out / "checkpoints" / "step-00000002.pt")
    assert saved["step"] == 2 and saved["micro_batch"] == 16
    assert_each_sample_once(trace, 3)
    assert_same_figures(out, started_at[16])


def test_a_run_lowered_stopped_and_resumed_matches_the_run_never_stopped(tmp_path):
    whole, _, _ = trained(tmp_path, "whole", "1:forward:32:1")
    stopped, _, _ = trained(tmp_path, "part", "1:forward:32:1", "--max-steps", "2")
    assert safe_load(stopped / "checkpoints" / "last.pt")["micro_batch"] == 16
    out, trace, stderr = trained(tmp_path, "part", "1:forward:32:1", "--resume", "auto")
    assert "auto: as the checkpoint found it on 3 x cpu" in stderr, stderr[-2000:]
    assert not lowered_lines(stderr)  # no search, no fault: 16 from the checkpoint
    assert_same_figures(out, whole)
    assert read_metrics(out)[-1]["train_loss"] == read_metrics(whole)[-1]["train_loss"]


def test_a_resume_on_another_world_searches_again_and_says_so(tmp_path):
    out, trace, _ = trained(tmp_path, "run", "1:forward:32:1", "--max-steps", "2")
    env = {"DDPCLI_FAKE_OOM": "1:forward:25", "DDPCLI_TRACE_SAMPLES": str(trace)}
    result = run_cli(
        *RUN, "--nproc", "2", "--global-batch", "96", "--out", str(out), "--resume", "auto",
        env=env, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "per-GPU batch 24 (searched again: the checkpoint's 16 was found on 3 x cpu; auto: 48 "
        "ran out of memory on rank 1; 24 ran) × accumulate 2 × world 2 = global batch 96"
    ) in result.stderr, result.stderr[-2000:]
    assert_each_sample_once(trace, 3)


def test_retries_have_an_end_and_the_saved_checkpoints_stay(tmp_path):
    out, _, stderr = trained(
        tmp_path, "run", "1:forward:1:2", "--save-every-steps", "1", nproc=2, code=1
    )
    assert re.search(
        r"out of memory at step 3: the forward pass on rank\(s\) 1 still ran out after 9 tries, "
        r"down to micro-batches of \d+; the checkpoints saved so far are kept",
        stderr,
    ), stderr[-2000:]
    assert "Traceback" not in stderr
    assert safe_load(out / "checkpoints" / "last.pt")["step"] == 2


def test_a_numeric_batch_out_of_memory_ends_the_run_as_before(tmp_path):
    out = tmp_path / "run"
    settings = [arg if arg != "auto" else "32" for arg in RUN]
    result = run_cli(
        *settings, "--nproc", "2", "--out", str(out),
        env={"DDPCLI_FAKE_OOM": "1:backward:32:1"}, timeout=180,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert "rank 1" in result.stderr and "OutOfMemoryError" in result.stderr
    assert "out of memory in backward at micro-batch 32" in result.stderr


# --- what is refused


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["--per-gpu-batch", "auto", "--global-batch", "100", "--nproc", "3"],
            "invalid --global-batch: 100 images cannot be shared by 3 ranks; give a multiple "
            "of 3, such as 99 or 102",
        ),
        (
            ["--per-gpu-batch", "16", "--global-batch", "100", "--nproc", "3"],
            "invalid --global-batch: 100 images cannot be shared by 3 ranks of 16 images; give "
            "a multiple of 48, such as 96 or 144",
        ),
        (
            ["--per-gpu-batch", "16", "--global-batch", "96", "--accumulate", "2"],
            "invalid --accumulate: 2 with --per-gpu-batch 16 on 2 ranks makes a global batch "
            "of 64, not --global-batch 96",
        ),
        (["--per-gpu-batch", "0"], "invalid --per-gpu-batch: give a number of images"),
        (
            ["--per-gpu-batch", "auto", "--sync-bn"],
            "invalid --sync-bn: not with --per-gpu-batch auto (SyncBatchNorm's collectives run "
            "inside the forward pass)",
        ),
    ],
)
def test_a_batch_that_cannot_be_planned_is_refused(in_process, args, said):
    result = in_process("train", "--cpu", *args, "--dry-run")
    assert result.returncode == 2 and said in result.stderr, result.stderr


def test_global_batch_sets_accumulate_and_auto_shares_it(in_process):
    import json

    result = in_process(
        "train", "--cpu", "--nproc", "3", "--per-gpu-batch", "16", "--global-batch", "96",
        "--dry-run", "--json",
    )  # fmt: skip
    plan = json.loads(result.stdout)
    assert (plan["accumulate"], plan["global_batch"]) == (2, 96)
    result = in_process(
        "train", "--cpu", "--nproc", "3", "--per-gpu-batch", "auto", "--accumulate", "2",
        "--dry-run", "--json",
    )  # fmt: skip
    plan = json.loads(result.stdout)
    assert (plan["per_gpu_batch"], plan["accumulate"], plan["batch_auto"]) == (128, 1, True)
    assert plan["global_batch"] == 384


def test_a_fake_oom_that_cannot_be_read_is_refused(in_process, monkeypatch):
    monkeypatch.setenv("DDPCLI_FAKE_OOM", "1:sideways:32")
    result = in_process("train", "--cpu", "--per-gpu-batch", "auto", "--dry-run")
    assert result.returncode == 2
    assert "invalid DDPCLI_FAKE_OOM: give RANK:PHASE:BATCH[:STEP]" in result.stderr


# --- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_auto_finds_a_batch_that_leaves_memory_free(tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train", "--gpus", "0", "--arch", "resnet18", "--per-gpu-batch", "auto",
        "--global-batch", "4096", "--image-size", "96", "--synthetic-size", "8192",
        "--epochs", "1", "--max-steps", "2", "--out", str(out), timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"per-GPU batch .*auto: .*leaves \d+% free", result.stderr), result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_step_out_of_memory_mid_run_goes_on_smaller(tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train", "--gpus", "0", "--arch", "resnet18", "--per-gpu-batch", "auto",
        "--global-batch", "256", "--image-size", "64", "--synthetic-size", "2048",
        "--epochs", "1", "--out", str(out), timeout=600,
        env={"DDPCLI_FAKE_OOM": "0:backward:129:3"},  # the whole 256 fits a GPU; then 128
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 4: out of memory in the backward pass on rank(s) 0" in result.stderr
    assert read_metrics(out)[-1]["global_batch"] == 256
