"""A run folder belongs to one run, and a run leaves nothing behind outside it.

The lock and the earlier-run rules run in-process (a flock conflicts between two open files
of one process too); one real run checks the launcher holds the lock while its workers
train, and real runs check the system's temporary directory is left as it was found.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import clean_env, run_cli, run_on_read_only_mount, write_noise_folder
from test_faults import SHORT_RUN, TINY, Background, assert_no_worker_left, child_workers

from ddpcli.config import TrainConfig
from ddpcli.config.plan import RunPlan
from ddpcli.environments import LauncherEnv, restarted_by
from ddpcli.errors import DdpcliError
from ddpcli.launcher.resolve import checked_settings
from ddpcli.launcher.resources import capacity_warnings
from ddpcli.outputs.runfolder import (
    RunFolderLock,
    claim_run_folder,
    describe_earlier_run,
    membership,
)


def config(out: Path, **settings) -> TrainConfig:
    settings = {"cpu": True, "nproc": 2, "arch": "tinycnn", "image_size": 16, **settings}
    return TrainConfig(out=out, **settings)


def first_stage(request: TrainConfig, environ: dict[str, str]) -> RunPlan:
    """The plan's first stage (ddpcli.launcher.plan), which takes a requeue as --resume auto;
    the second would check this test's stand-in checkpoint."""
    return RunPlan.model_validate(checked_settings(request, None, environ))


def earlier_run(out: Path, epochs: int = 2, planned: int = 4) -> None:
    """What a run that finished EPOCHS of PLANNED leaves: metrics, config, checkpoints."""
    (out / "checkpoints").mkdir(parents=True)
    lines = [{"epoch": e, "val_acc": 0.1 * e, "train_loss": 1.0} for e in range(1, epochs + 1)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (out / "config.json").write_text(json.dumps({"epochs": planned}))
    for name in ("epoch-0002.pt", "last.pt", "best.pt", "last.pt.sha256"):
        (out / "checkpoints" / name).write_bytes(b"x")


# --- 1. The lock ------------------------------------------------------------------------------


def test_a_second_run_into_a_locked_folder_is_refused_naming_the_holder(tmp_path):
    first = RunFolderLock(tmp_path, job=None, member=0)
    first.acquire()
    try:
        with pytest.raises(DdpcliError) as refused:
            RunFolderLock(tmp_path, job=None, member=0).acquire()
        assert refused.value.exit_code == 2
        assert f"pid {os.getpid()} on " in refused.value.message
        assert "in use by another run" in refused.value.message
    finally:
        first.release()
    again = RunFolderLock(tmp_path, job=None, member=0)
    again.acquire()  # released: the folder is free again
    again.release()


def test_the_nodes_of_one_job_share_the_folder_and_no_one_else_does(tmp_path):
    job = "10.0.0.1:29500, 2 nodes"
    node0 = RunFolderLock(tmp_path, job=job, member=0)
    node0.acquire()
    try:
        RunFolderLock(tmp_path, job=job, member=1).acquire()  # admitted: the same job
        for other_job, member in ((job, 0), ("10.0.0.1:29501, 2 nodes", 1), (None, 1)):
            with pytest.raises(DdpcliError, match="in use by another run"):
                RunFolderLock(tmp_path, job=other_job, member=member).acquire()
    finally:
        node0.release()


def test_the_launcher_holds_the_lock_and_its_workers_read_a_private_config(tmp_path, in_process):
    """A second run into a folder in use exits 2 at once, naming the first; the first's
    workers read their config from a folder of the launch's own, not from --out (where a
    second run would rewrite it before they read it)."""
    out = tmp_path / "run"
    args = [*TINY, "--per-gpu-batch", "16", "--synthetic-size", "8192", "--epochs", "5"]
    slow = clean_env(DDPCLI_SLOW_DATA="0:0.5")  # mid-epoch 1 all along, by sleeping
    with Background("train", *args, "--log-every", "1", "--out", str(out), env=slow) as first:
        first.wait_for("epoch 1/5 step 2/")
        second = in_process("train", *SHORT_RUN, "--out", str(out))
        workers = child_workers(first.process.pid)
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"pid {first.process.pid} on " in second.stderr, second.stderr
    assert sorted(workers) == [0, 1]
    assert not list(out.glob(".launch-config*"))
    assert sorted(path.name for path in out.iterdir() if path.suffix == ".json") == ["config.json"]
    assert_no_worker_left(out)


# --- 2. An earlier run in the folder ------------------------------------------------------------


def test_an_earlier_run_is_refused_saying_what_is_there(tmp_path):
    earlier_run(tmp_path)
    with pytest.raises(DdpcliError) as refused, claim_run_folder(config(tmp_path), None):
        pass
    message = refused.value.message
    assert refused.value.exit_code == 2
    assert "2 of 4 epochs done" in message and "best val acc 20.00%" in message
    assert "--resume auto" in message and "another --out" in message and "--overwrite" in message
    assert (tmp_path / "checkpoints" / "best.pt").exists()  # nothing touched


def test_a_partial_run_without_metrics_is_an_earlier_run_too(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"x")
    assert describe_earlier_run(tmp_path) == "no epoch finished, checkpoints/last.pt"
    assert describe_earlier_run(tmp_path / "empty") is None


def test_resume_continues_and_overwrite_clears_only_what_a_run_writes(tmp_path):
    earlier_run(tmp_path)
    with claim_run_folder(config(tmp_path, resume="auto"), None):
        assert (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "checkpoints" / "README").write_text("mine")
    with claim_run_folder(config(tmp_path, overwrite=True), None):
        pass
    left = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*"))
    assert left == [".lock", "checkpoints", "checkpoints/README", "notes.txt"]


def test_overwrite_and_resume_auto_exclude_each_other():
    with pytest.raises(ValueError, match="--overwrite"):
        TrainConfig(overwrite=True, resume="auto")


def test_the_cli_refuses_an_earlier_run_before_any_worker_starts(tmp_path, in_process):
    earlier_run(tmp_path)
    result = in_process("train", *SHORT_RUN, "--out", str(tmp_path))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "already holds a run (2 of 4 epochs done, best val acc 20.00%" in result.stderr
    assert "Traceback" not in result.stderr
    assert (tmp_path / "checkpoints" / "epoch-0002.pt").exists()


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"SLURM_RESTART_COUNT": "1"}, "SLURM_RESTART_COUNT=1"),
        ({"TORCHELASTIC_RESTART_COUNT": "2"}, "TORCHELASTIC_RESTART_COUNT=2"),
        ({"SLURM_RESTART_COUNT": "0"}, None),
        ({}, None),
    ],
)
def test_a_requeue_is_read_from_the_scheduler(variables, expected):
    assert restarted_by(variables) == expected


def test_a_requeued_job_resumes_by_itself(tmp_path, capsys):
    earlier_run(tmp_path)
    cfg = first_stage(config(tmp_path, overwrite=True), {"SLURM_RESTART_COUNT": "1"})
    assert cfg.resume == "auto" and not cfg.overwrite  # a requeue never clears the run
    assert "SLURM_RESTART_COUNT=1: this job was started again" in capsys.readouterr().err
    with claim_run_folder(cfg, None):
        assert (tmp_path / "metrics.jsonl").exists()
    first_start = first_stage(config(tmp_path), {})
    assert first_start.resume is None


def test_every_rank_under_an_outside_launcher_is_admitted(tmp_path):
    ranks = [
        LauncherEnv(rank=rank, local_rank=rank, world_size=2, local_world_size=2,
                    master_addr="127.0.0.1", master_port=29511)
        for rank in (0, 1)
    ]  # fmt: skip
    with claim_run_folder(config(tmp_path), ranks[0]), claim_run_folder(config(tmp_path), ranks[1]):
        pass


# --- 4. Folders that cannot be written -----------------------------------------------------


def test_an_out_or_log_dir_that_is_a_file_is_exit_2(tmp_path, in_process):
    a_file = tmp_path / "file"
    a_file.write_text("")
    for flag in ("--out", "--log-dir"):
        result = in_process("train", "--cpu", flag, str(a_file / "run"), "--dry-run")
        assert result.returncode == 2, result.stderr
        assert f"invalid {flag}:" in result.stderr and f"{a_file} is a file" in result.stderr
        assert "Traceback" not in result.stderr and "unexpected" not in result.stderr


def test_an_out_on_a_read_only_file_system_is_exit_2(tmp_path):
    folder = tmp_path / "ro"
    result = run_on_read_only_mount(folder, f"train {' '.join(SHORT_RUN)} --out {folder}/run")
    assert result.returncode == 2, result.stderr
    assert "invalid --out:" in result.stderr and "read-only file system" in result.stderr


# --- 5. Nothing left outside --out ----------------------------------------------------------


def left_in(temporary: Path) -> list[str]:
    """What runs left there, less torch's per-user compile cache (`torchinductor_<user>`:
    one folder that every run shares, made when torchvision is imported)."""
    return [path.name for path in temporary.iterdir() if not path.name.startswith("torchinductor_")]


def test_a_run_leaves_nothing_in_the_temporary_directory(tmp_path):
    """torch elastic makes a torchelastic_* folder per run unless told where to write."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {"TMPDIR": str(temporary)}
    ok = run_cli("train", *SHORT_RUN, "--out", str(tmp_path / "ok"), env=env, timeout=180)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert left_in(temporary) == []
    trace = tmp_path / "trace"
    trace.with_name("trace.rank1").mkdir()  # rank 1 cannot open its trace file: it fails
    failed = run_cli(
        "train", *SHORT_RUN, "--out", str(tmp_path / "failed"), "--timeout", "20",
        env={**env, "DDPCLI_TRACE_SAMPLES": str(trace)}, timeout=180,
    )  # fmt: skip
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert left_in(temporary) == []


def test_a_long_tmpdir_still_trains_and_a_loader_that_cannot_work_in_it_exits_2(tmp_path):
    """A scheduler's job folder as TMPDIR can leave no room for multiprocessing's UNIX
    sockets (107 bytes a path): the fork server failed with "AF_UNIX path too long", and
    DataLoader workers could not hand a batch over, so every rank waited for good."""
    temporary = tmp_path / ("job-folder-" + "x" * 80)
    temporary.mkdir()
    env = {"TMPDIR": str(temporary)}
    ok = run_cli("train", *SHORT_RUN, "--out", str(tmp_path / "ok"), env=env, timeout=180)
    assert ok.returncode == 0, ok.stderr[-3000:]  # its workers start as programs instead
    assert left_in(temporary) == []
    write_noise_folder(tmp_path / "folder", per_class=8)
    folder = ["--dataset", "imagefolder", "--data-dir", str(tmp_path / "folder")]
    args = [*TINY, *folder, "--nproc", "2", "--workers", "1", "--per-gpu-batch", "4"]
    refused = run_cli("train", *args, "--out", str(tmp_path / "no"), env=env, timeout=180)
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "TMPDIR" in errors[0] and "--workers 0" in errors[0], errors
    assert "Traceback" not in refused.stderr


# --- 6. Warnings before launch --------------------------------------------------------------


def test_more_processes_than_cores_and_memory_get_a_warning_with_the_arithmetic(monkeypatch):
    monkeypatch.setattr("ddpcli.launcher.resources.cpu_count", lambda: 2)
    cfg = config(Path("out"), nproc=64)
    cores, memory = capacity_warnings(cfg, available_bytes=8e9)
    assert "64 processes on 2 core(s)" in cores and "(2 / 64)" in cores
    assert "64 processes x 0." in memory and "8.0 GB is available" in memory
    assert capacity_warnings(config(Path("out"), nproc=2), available_bytes=64e9) == []


def test_the_warning_comes_before_launch(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from ddpcli.cli import app
    from ddpcli.errors import runtime_error

    def no_launch(job, debug=False):
        raise runtime_error("(the test stops here)")

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("ddpcli.launcher.train_launch.run_workers", no_launch)
    monkeypatch.setattr("ddpcli.launcher.resources.cpu_count", lambda: 2)
    result = CliRunner().invoke(
        app, ["train", "--cpu", "--nproc", "64", "--arch", "tinycnn", "--out", str(tmp_path)]
    )
    assert result.exit_code == 1
    assert "64 processes on 2 core(s)" in result.stderr


def test_the_hosts_of_one_elastic_job_share_the_folder_and_a_late_one_joins(tmp_path):
    """Elastic hosts have no node rank: each is a member by host and pid, and one that
    joins a running job finds its metrics there without being refused."""
    elastic = config(tmp_path, nnodes="2:3", rdzv_endpoint="10.0.0.1:29400")
    job, member = membership(elastic, None)
    assert job == "rendezvous ddpcli at 10.0.0.1:29400, 2:3 nodes" and isinstance(member, str)
    other = config(tmp_path, nnodes="2:3", rdzv_endpoint="10.0.0.1:29400", rdzv_id="other")
    assert membership(other, None)[0] != job
    holder = RunFolderLock(tmp_path, job=job, member="host-a pid 1")
    holder.acquire()
    try:
        earlier_run(tmp_path)  # the job's own first epochs
        with claim_run_folder(elastic, None):
            pass  # admitted: the same job, and its earlier epochs are its own
        with pytest.raises(DdpcliError, match="in use"), claim_run_folder(other, None):
            pass
    finally:
        holder.release()
