"""A scheduler ends a job by signalling every process of it (SLURM's step signal, systemd's
control group, `kill -TERM -- -PGID`), not its launcher alone: the launcher's process group
(the launcher, its fork server, multiprocessing's resource tracker), and beyond it each rank
(in a session of its own) and each rank's loader workers. A training run still saves its
preemption checkpoint and says how to resume; `ddpcli launch` still lets the script answer
the signal; nothing is left running. Real jobs on the CPU with Gloo, signalled mid-run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import LiveProcess, clean_env, write_noise_folder
from test_faults import assert_no_worker_left, child_workers, descendants
from test_launch import assert_none_left, write_script

STARTUP_S = 90  # imports and rendezvous on a busy two-core machine

# 72 images, 2 ranks of batch 2: 18 steps, each rank 1's data 0.2 s late. A loader worker per
# rank, for the signal to reach them too.
TRAIN = [
    "--cpu", "--nproc", "2", "--arch", "tinycnn", "--image-size", "16", "--per-gpu-batch", "2",
    "--epochs", "1", "--log-every", "1", "--workers", "1", "--timeout", "60",
]  # fmt: skip
SLOWED = {"DDPCLI_SLOW_DATA": "1:0.2"}


def sigterm_to_the_job(run: LiveProcess, every_process: bool) -> list[int]:
    """SIGTERM to RUN's process group and (EVERY_PROCESS) to each process it started, as a
    scheduler sends it; the pids signalled beyond the group."""
    beyond = descendants(run.process.pid) if every_process else []
    os.killpg(run.process.pid, signal.SIGTERM)
    for pid in beyond:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    return beyond


def sigterm_to_every_process_once(run: LiveProcess, ready: Callable[[], bool]) -> int:
    """Once READY says RUN is up (looked at 20 times a second), SIGTERM to every process of
    it; its exit code. RUN is killed whatever happens."""
    try:
        deadline = time.monotonic() + STARTUP_S
        while not ready():
            assert time.monotonic() < deadline and run.process.poll() is None, run.stderr
            time.sleep(0.05)
        sigterm_to_the_job(run, every_process=True)
        return run.finish(timeout=60)
    finally:
        run.kill()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, list[str]]:
    """An image folder (24 images a class, 3 classes) and the same images packed in shards,
    as train's flags name them."""
    from typer.testing import CliRunner

    from ddpcli.cli import app

    root = tmp_path_factory.mktemp("signals")
    write_noise_folder(root / "folder", per_class=24)
    # Packed in this process, by one worker (the same bytes as any number packs): no
    # interpreter, torch import and pool of processes for 144 small images.
    packed = CliRunner().invoke(app, ["data", "pack", str(root / "folder"), str(root / "shards"),
                                      "--shard-size", "20KB", "--workers", "1"])  # fmt: skip
    assert packed.exit_code == 0, packed.output[-2000:]
    return {
        "folder": ["--dataset", "imagefolder", "--data-dir", str(root / "folder")],
        "shards": ["--data-dir", str(root / "shards")],
    }


def tinycnn_checkpoint(path: Path) -> Path:
    """An untrained tinycnn for write_noise_folder's 3 classes, as a checkpoint eval reads."""
    from ddpcli.checkpoint.schema import FORMAT
    from ddpcli.files import atomic_save
    from ddpcli.models.build import build_model

    payload = {
        "format": FORMAT,
        "model": build_model("tinycnn", 3).state_dict(),
        "epoch": 1,
        "step": 4,
        "num_classes": 3,
        "classes": ["cat", "dog", "owl"],
        "normalization": {"mean": [0.5, 0.5, 0.5], "std": [0.2, 0.2, 0.2]},
        "config": {"arch": "tinycnn", "image_size": 16, "val_resize_size": 16,
                   "val_crop_size": 16, "dataset": "imagefolder", "model_args": {}},
    }  # fmt: skip
    atomic_save(payload, path)
    return path


@pytest.mark.parametrize(("source", "every_process"), [("folder", False), ("shards", True)])
def test_sigterm_to_the_whole_job_saves_a_preemption_checkpoint(
    data, tmp_path, source, every_process
):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "ddpcli", "train", *TRAIN, *data[source], "--out", str(out)]
    run = LiveProcess(command, clean_env(**SLOWED))
    try:
        run.wait_for("epoch 1/1 step 2/", STARTUP_S)  # training, its loader workers started
        beyond = sigterm_to_the_job(run, every_process)
        code = run.finish(timeout=90)
    finally:
        run.kill()
    stderr = run.stderr
    # The fork server, 2 ranks and a loader worker each, beyond the group.
    assert not every_process or len(beyond) >= 5, beyond
    assert code == 1, stderr[-3000:]
    assert "Traceback" not in stderr and "none inside the training loop" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: preempted at epoch 1 step "), stderr[-3000:]
    assert f"--out {out} --resume auto" in last
    assert list((out / "checkpoints").glob("step-*.pt")), "no preemption checkpoint"
    assert_no_worker_left(out)


def test_sigterm_to_every_process_of_an_eval_stops_it_in_one_line(data, tmp_path):
    """Signalled as soon as its ranks are up (an evaluation this small is over in a second)."""
    checkpoint = tinycnn_checkpoint(tmp_path / "best.pt")
    out = tmp_path / "eval"
    command = [sys.executable, "-m", "ddpcli", "eval", str(checkpoint), *data["folder"][2:],
               "--cpu", "--nproc", "2", "--workers", "1", "--out", str(out)]  # fmt: skip
    run = LiveProcess(command, clean_env())
    # Each look reads every process's /proc entry (milliseconds of CPU on a busy machine):
    # 20 a second, not 50, through the start-up.
    code = sigterm_to_every_process_once(run, lambda: len(child_workers(run.process.pid)) >= 2)
    assert code == 1, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: got SIGTERM"], run.stderr[-3000:]
    assert not (out / "metrics.json").exists()
    assert_none_left(str(checkpoint))


# The script saves what a script saves on SIGTERM (here: a file per rank), once, and leaves.
ANSWERS_SIGTERM = """
    import os, pathlib, signal, sys, time

    folder = pathlib.Path(sys.argv[1])
    rank = os.environ["RANK"]

    def save_and_leave(signum, frame):
        (folder / f"saved{rank}").write_text(signal.Signals(signum).name)
        os._exit(0)

    signal.signal(signal.SIGTERM, save_and_leave)
    (folder / f"up{rank}").touch()
    time.sleep(600)
"""


def test_sigterm_to_every_process_of_a_launch_reaches_the_script(tmp_path):
    script = write_script(tmp_path, "answers_sigterm.py", ANSWERS_SIGTERM)
    command = [sys.executable, "-m", "ddpcli", "launch", "--nproc", "2", str(script),
               str(tmp_path)]  # fmt: skip
    run = LiveProcess(command, clean_env())
    code = sigterm_to_every_process_once(
        run, lambda: all((tmp_path / f"up{rank}").exists() for rank in (0, 1))
    )
    assert code == 1, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        f"error: got SIGTERM: stopped the 2 worker(s) of {script} on this node"
    )
    assert [(tmp_path / f"saved{rank}").read_text() for rank in (0, 1)] == ["SIGTERM"] * 2
    assert_none_left(str(script))
