"""`--resume` checked as the run would check it, by a dry run too, and its file hashed once
(by the launcher; a worker that finds the same file there does not read it all again)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddpcli.config import TrainConfig
from ddpcli.config.data import WITH_CREDENTIALS
from ddpcli.files import atomic_save

TINY_DRY = ["--cpu", "--nproc", "2", "--arch", "tinycnn", "--image-size", "16", "--dry-run"]


def resumable_payload() -> dict:
    """The keys a training checkpoint holds; what resume's checks read of them."""
    return {
        "model": {"weight": torch.ones(4)},
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": {},
        "epoch": 1,
        "batch_in_epoch": 0,
        "step": 4,
        "metrics": [],
        "config": {"optimizer": "sgd"},
        "rng": [],
        "world_size": 1,
    }


def one_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_a_dry_run_refuses_a_missing_resume_file_as_the_run_does(in_process, tmp_path):
    out, missing = tmp_path / "run", tmp_path / "MISSING.pt"
    result = in_process("train", *TINY_DRY, "--out", str(out), "--resume", str(missing))
    assert result.returncode == 2
    assert one_line(result) == f"error: checkpoint {missing} does not exist"
    # --resume auto without a checkpoint starts afresh, dry or not (CONTRACT: "if it exists")
    result = in_process("train", *TINY_DRY, "--out", str(out), "--resume", "auto")
    assert result.returncode == 0, result.stderr
    assert not out.exists()  # a dry run writes nothing


def test_resume_hashes_the_file_once_unless_it_changed_since_the_check(tmp_path, monkeypatch):
    from ddpcli import files
    from ddpcli.checkpoint.schema import load_training_checkpoint
    from ddpcli.config.plan import RunPlan
    from ddpcli.launcher.plan import plan_run

    last = tmp_path / "run" / "checkpoints" / "last.pt"
    atomic_save(resumable_payload(), last)
    hashed: list[Path] = []
    real_sha256 = files.file_sha256
    monkeypatch.setattr(files, "file_sha256", lambda path: hashed.append(path) or real_sha256(path))

    cfg = plan_run(TrainConfig(resume="auto", out=tmp_path / "run", cpu=True), None)  # the launcher
    assert len(hashed) == 1
    # The worker reads its config from the launcher's request
    worker_cfg = RunPlan.model_validate_json(cfg.model_dump_json(context={WITH_CREDENTIALS: True}))
    load_training_checkpoint(last, "cpu", worker_cfg.resume_checked)
    assert len(hashed) == 1

    atomic_save(resumable_payload(), last)  # a newer last.pt, as a restarted worker finds it
    load_training_checkpoint(last, "cpu", worker_cfg.resume_checked)
    assert len(hashed) == 2


def test_the_launchers_record_of_its_check_is_no_setting(tmp_path):
    from ddpcli.config import build_train_config
    from ddpcli.errors import DdpcliError

    recipe = tmp_path / "recipe.toml"
    recipe.write_text('resume_checked = "anything"\n')
    with pytest.raises(DdpcliError, match="resume_checked is not a setting"):
        build_train_config({}, recipe)


def test_resume_auto_without_the_runs_arch_is_refused_before_any_rank_starts(in_process, tmp_path):
    """The file names its arch; a resume that asks for another one (here: no --arch, so the
    default) would launch and have every rank list shape mismatches. Exit 2 first, naming both."""
    out = tmp_path / "run"
    last = out / "checkpoints" / "last.pt"
    payload = resumable_payload()
    payload["config"]["arch"] = "tinycnn"
    atomic_save(payload, last)
    without_arch = [flag for flag in TINY_DRY if flag not in ("--arch", "tinycnn")]
    result = in_process("train", *without_arch, "--out", str(out), "--resume", "auto")
    assert result.returncode == 2
    assert one_line(result) == (
        f"error: cannot resume from {last}: it was trained with --arch tinycnn, this run asks "
        "for --arch smallcnn; resume with --arch tinycnn, or give another --out to start a new "
        "smallcnn run"
    )
    result = in_process("train", *TINY_DRY, "--out", str(out), "--resume", "auto")
    assert result.returncode == 0, result.stderr  # the run's own arch resumes
