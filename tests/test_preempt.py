"""Stopping a training run early, for real on the CPU with Gloo: a preemption signal to one
worker (or to the launcher) saves a mid-epoch checkpoint and exits 1 with the resume
command, and resuming from it ends exactly where the uninterrupted run ends; Ctrl-C prints
one line, exits 130 and leaves no process.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest
from conftest import LiveProcess, clean_env, read_metrics, run_cli
from test_faults import assert_no_worker_left, child_workers

# 2048 images, batch 16, two ranks: 64 steps in the epoch, each of rank 1's batches 0.1 s
# late (a sleep, no CPU, and rank 0 waits for it at the all-reduce): 6 s to act mid-epoch
# once training shows, on a busy machine too, with next to no training done meanwhile.
SETTINGS = [
    "--cpu", "--arch", "tinycnn", "--image-size", "16", "--synthetic-size", "2048",
    "--per-gpu-batch", "16", "--epochs", "1", "--nproc", "2", "--log-every", "1",
]  # fmt: skip
SLOW_STEPS = {"DDPCLI_SLOW_DATA": "1:0.1"}
COMPARED = ("train_loss", "train_acc", "val_loss", "val_acc", "lr")
STARTUP_S = 90


def started(out, *extra: str, settings=SETTINGS, env: dict | None = None) -> LiveProcess:
    command = [sys.executable, "-m", "ddpcli", "train", *settings, "--out", str(out), *extra]
    run = LiveProcess(command, clean_env(**(SLOW_STEPS if env is None else env)))
    run.wait_for("epoch 1/1 step 2/", STARTUP_S)  # training, not starting up
    return run


# This test trains the whole epoch twice (the reference, and the stop plus its resume): a
# quarter of the set, each of rank 1's 16 batches 0.15 s late, keeps the SIGTERM mid-epoch
# (2 s to spare after step 2) at a quarter of the steps.
WHOLE_EPOCH = [value if value != "2048" else "512" for value in SETTINGS]
SLOWED = {"DDPCLI_SLOW_DATA": "1:0.15"}


def test_sigterm_to_one_worker_saves_and_the_resume_matches_the_whole_run(tmp_path):
    reference = tmp_path / "reference"
    whole = run_cli("train", *WHOLE_EPOCH, "--out", str(reference), env=SLOWED, timeout=240)
    assert whole.returncode == 0, whole.stderr[-3000:]

    out = tmp_path / "run"
    run = started(out, settings=WHOLE_EPOCH, env=SLOWED)
    try:
        os.kill(child_workers(run.process.pid)[1], signal.SIGTERM)  # rank 1 only
        code = run.finish(timeout=90)
    finally:
        run.kill()
    assert code == 1, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "SignalException" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: preempted at epoch 1 step "), last
    assert "resume: ddpcli train" in last and f"--out {out} --resume auto" in last
    assert list((out / "checkpoints").glob("step-*.pt")), "no mid-epoch checkpoint"
    assert_no_worker_left(out)

    resumed = run_cli(
        "train", *WHOLE_EPOCH, "--out", str(out), "--resume", "auto", env=SLOWED, timeout=240
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and ", batch " in resumed.stderr
    got, want = read_metrics(out), read_metrics(reference)
    assert len(got) == len(want) == 1
    for key in COMPARED:
        assert got[0][key] == pytest.approx(want[0][key], rel=1e-6, abs=1e-12), key


def test_usr1_to_the_launcher_saves_with_preempt_signal_usr1(tmp_path):
    out = tmp_path / "run"
    run = started(out, "--preempt-signal", "USR1")
    try:
        run.process.send_signal(signal.SIGUSR1)
        code = run.finish(timeout=90)
    finally:
        run.kill()
    assert code == 1, run.stderr[-3000:]
    assert "error: preempted at epoch 1 step " in run.stderr, run.stderr[-3000:]
    assert "stopped by SIGUSR1 after batch" in run.stderr
    assert "death signal" not in run.stderr  # elastic's own warning, which says less
    # Saved before anything else: the scheduler's grace is short, the resume validates.
    assert "not validated" in run.stderr
    assert list((out / "checkpoints").glob("step-*.pt"))
    assert_no_worker_left(out)


def test_ctrl_c_prints_one_line_exits_130_and_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    run = started(out)
    try:
        run.process.send_signal(signal.SIGINT)  # the terminal signals the foreground group
        code = run.finish(timeout=90)
    finally:
        run.kill()
    assert code == 130, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "KeyboardInterrupt" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr[-3000:]
    assert errors[0].startswith("error: interrupted at epoch 1 step "), errors
    assert f"--out {out} --resume auto" in errors[0]
    assert_no_worker_left(out)
