"""Checkpoints a user can trust: atomic writes, safe loads, inspect / verify / convert.

Most command tests run in-process through Typer's CliRunner (no torch import per call);
the claims that matter most (a malicious file is refused, a broken file is one line, a
kill mid-save keeps last.pt) also run as real processes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO, clean_env, run_bounded, run_cli, run_on_read_only_mount
from typer.testing import CliRunner

from ddpcli import files
from ddpcli.checkpoint.loading import safe_load
from ddpcli.checkpoint.schema import (
    FORMAT,
    capture_rng_state,
    load_training_checkpoint,
    restore_rng_state,
)
from ddpcli.checkpoint.writer import CheckpointWriter
from ddpcli.cli import app
from ddpcli.config import TrainConfig
from ddpcli.errors import DdpcliError
from ddpcli.files import atomic_save, digest_status, sha256_path
from ddpcli.launcher.plan import plan_run

TINY_TRAIN = [
    "--cpu", "--nproc", "2", "--arch", "tinycnn", "--image-size", "16",
    "--synthetic-size", "64", "--per-gpu-batch", "16", "--epochs", "1",
]  # fmt: skip


def invoke(*args: str):
    """`ddpcli ARGS` in-process; stdout and stderr apart, as a terminal user sees them."""
    return CliRunner().invoke(app, list(args))


def training_payload(arch: str = "tinycnn", num_classes: int = 10, prefix: str = "") -> dict:
    """What Trainer.checkpoint_payload writes, built without a training run."""
    from ddpcli.models.build import build_model
    from ddpcli.training.param_groups import weight_decay_groups

    torch.manual_seed(0)
    model = build_model(arch, num_classes)
    # The trainer's parameter groups (decay, no decay): a resume loads them into its own.
    groups = weight_decay_groups(model, weight_decay=5e-4, norm_weight_decay=0.0)
    optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    # The plan a run saves (ddpcli.launcher.plan): with its peak_lr, as every checkpoint has.
    config = plan_run(TrainConfig(arch=arch, epochs=3, cpu=True, image_size=16), None)
    return {
        "format": FORMAT,
        "model": {prefix + key: value for key, value in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": None,
        "epoch": 1,
        "batch_in_epoch": 0,
        "step": 8,
        "best_val_acc": 0.5,
        "metrics": [{"epoch": 1, "train_loss": 2.3, "val_loss": 2.2, "val_acc": 0.5}],
        "partial_sums": None,
        "world_size": 2,
        "num_classes": num_classes,
        "config": json.loads(config.model_dump_json()),
        "rng": [capture_rng_state(), capture_rng_state()],
    }


@pytest.fixture
def saved(tmp_path) -> Path:
    path = tmp_path / "ckpt.pt"
    atomic_save(training_payload(), path)
    return path


# --- 1. What a checkpoint holds, and that it loads safely ------------------------------------


def test_rng_states_round_trip_through_a_safe_load(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    atomic_save({"rng": [capture_rng_state()]}, tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(safe_load(tmp_path / "rng.pt")["rng"][0])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_our_payload_is_tensors_and_plain_types(saved):
    payload = safe_load(saved)  # weights_only=True: would raise on any other object
    assert not any(key.startswith("module.") for key in payload["model"])
    assert payload["config"]["arch"] == "tinycnn"
    assert isinstance(payload["rng"][1]["numpy"]["keys"], torch.Tensor)


# --- 3. A checkpoint from a GPU loads on the CPU ------------------------------------------------


def save_as_if_on_cuda(obj, path: Path, monkeypatch) -> None:
    """torch.save tags each storage with its device; this writes exactly what a save from
    cuda:0 writes, on a machine without CUDA."""
    import torch.serialization

    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(obj, path)


def test_checkpoint_written_on_cuda_loads_on_cpu(tmp_path, monkeypatch):
    path = tmp_path / "gpu.pt"
    save_as_if_on_cuda(training_payload(), path, monkeypatch)
    payload = load_training_checkpoint(path, map_location=torch.device("cpu"))
    assert payload["model"]["fc.weight"].device.type == "cpu"
    restore_rng_state(payload["rng"][0])
    report = json.loads(invoke("checkpoint", "inspect", str(path), "--json").stdout)
    assert report["devices"] == {"cuda:0": report["tensors"]}


# --- 4. Atomic and durable writes, --keep-last ------------------------------------------------


def test_atomic_save_records_its_digest_and_leaves_no_temporaries(tmp_path):
    digest = atomic_save({"w": torch.ones(10)}, tmp_path / "last.pt")
    assert sha256_path(tmp_path / "last.pt").read_text().split()[0] == digest
    assert digest_status(tmp_path / "last.pt")["status"] == "ok"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "last.pt.sha256"]


SLOW_SAVE = r"""
import sys, time
import torch
from ddpcli import files

class SlowWriter(files.HashingWriter):
    def write(self, data):  # dribble the bytes out so the parent can kill us mid-file
        view = memoryview(data).cast("B")
        for start in range(0, len(view), 1 << 16):
            super().write(view[start : start + (1 << 16)])
            self.handle.flush()
            time.sleep(0.01)
        return len(view)

files.HashingWriter = SlowWriter
files.atomic_save({"epoch": 2, "weights": torch.full((4_000_000,), 2.0)}, sys.argv[1])
"""


def wait_for_partial_file(directory: Path, min_bytes: int, timeout: float) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for candidate in directory.glob(".last.pt.*.tmp"):
            if candidate.stat().st_size >= min_bytes:
                return candidate
        time.sleep(0.02)
    raise AssertionError("the save never started writing its temporary file")


def test_kill_during_save_leaves_the_previous_last_intact(tmp_path):
    last = tmp_path / "last.pt"
    atomic_save({"epoch": 1, "weights": torch.full((4_000_000,), 1.0)}, last)
    before = last.read_bytes()
    child = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, str(last)], cwd=REPO)
    try:
        partial = wait_for_partial_file(tmp_path, min_bytes=1 << 20, timeout=60)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert partial.exists() and partial.stat().st_size < len(before)  # killed mid-write
    assert last.read_bytes() == before
    payload = safe_load(last, check_digest=True)
    assert payload["epoch"] == 1 and bool((payload["weights"] == 1.0).all())
    # The next save of the run sweeps the orphaned temporary file.
    writer = CheckpointWriter(TrainConfig(out=tmp_path.parent, keep_last=0), main_rank())
    writer.directory = tmp_path
    writer.save({"epoch": 3}, "epoch-0003.pt", is_best=False)
    assert not partial.exists()


def test_digest_sidecar_matches_the_file_at_every_instant_of_a_replace(tmp_path):
    """A kill between writing the new sidecar and renaming the file leaves the old file with a
    sidecar that still vouches for it; a good file never looks corrupt."""
    last = tmp_path / "last.pt"
    atomic_save({"epoch": 1}, last)
    tmp = tmp_path / ".last.pt.new.tmp"
    new_digest = atomic_save({"epoch": 2}, tmp)
    previous = files.recorded_digests(last)
    files._record_digests(last, [new_digest, *previous])  # killed right after this
    assert digest_status(last)["status"] == "ok"
    os.replace(tmp, last)  # ...or right after this
    assert digest_status(last)["status"] == "ok"


def main_rank():
    return SimpleNamespace(is_main=True, distributed=False, rank=0, world_size=1)


def test_keep_last_keeps_the_newest_numbered_files_besides_last_and_best(tmp_path):
    writer = CheckpointWriter(TrainConfig(out=tmp_path, keep_last=2), main_rank())
    names = ["step-00000003.pt", "epoch-0001.pt", "step-00000011.pt", "epoch-0002.pt"]
    for index, name in enumerate(names):
        writer.save({"index": index}, name, is_best=index == 1)
    kept = sorted(p.name for p in writer.directory.glob("*.pt"))
    assert kept == ["best.pt", "epoch-0002.pt", "last.pt", "step-00000011.pt"]
    assert safe_load(writer.directory / "last.pt", check_digest=True)["index"] == 3
    assert safe_load(writer.directory / "best.pt", check_digest=True)["index"] == 1
    assert not list(writer.directory.glob("epoch-0001.pt*"))  # sidecar pruned with it


# --- 5. Safety: a malicious file is refused and nothing in it runs ------------------------------


class CreatesMarker:
    """Unpickling this calls open(marker, "w"): proof that a load ran code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def malicious_checkpoint(directory: Path) -> tuple[Path, Path]:
    path, marker = directory / "evil.pt", directory / "MARKER"
    payload = training_payload()
    payload["metrics"] = [CreatesMarker(marker)]
    torch.save(payload, path)
    return path, marker


def test_the_malicious_file_would_run_code_if_loaded_unsafely(tmp_path):
    path, marker = malicious_checkpoint(tmp_path)
    torch.load(path, weights_only=False)  # what a careless tool does
    assert marker.exists()


@pytest.mark.parametrize("command", ["inspect", "verify", "convert"])
def test_malicious_checkpoint_is_refused_and_nothing_runs(tmp_path, command):
    path, marker = malicious_checkpoint(tmp_path)
    extra = [str(tmp_path / "out.pt")] if command == "convert" else []
    result = invoke("checkpoint", command, str(path), *extra)
    assert result.exit_code == 2
    assert "refused" in result.stderr and "io.open" in result.stderr
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists()


def test_malicious_checkpoint_refused_by_the_real_cli_and_by_train_resume(tmp_path, in_process):
    path, marker = malicious_checkpoint(tmp_path)
    inspect = run_cli("checkpoint", "inspect", str(path), timeout=60)
    assert inspect.returncode == 2, inspect.stderr
    assert inspect.stderr.count("\n") == 1 and "refused" in inspect.stderr
    train = in_process("train", *TINY_TRAIN, "--out", str(tmp_path / "run"), "--resume", str(path))
    assert train.returncode == 2, train.stderr[-2000:]
    assert "refused" in train.stderr and "Traceback" not in train.stderr
    assert not marker.exists()
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained


def test_raw_pickle_with_a_global_is_refused(tmp_path):
    import pickle

    path, marker = tmp_path / "raw.pt", tmp_path / "MARKER"
    path.write_bytes(pickle.dumps({"model": CreatesMarker(marker)}, protocol=2))
    with pytest.raises(DdpcliError, match="refused") as error:
        safe_load(path)
    assert error.value.exit_code == 2 and not marker.exists()


# --- 7. Missing, truncated or corrupt: exit 2, one line ---------------------------------------


def broken_files(directory: Path, good: Path) -> dict[str, Path]:
    data = good.read_bytes()
    files = {
        "missing": directory / "nope.pt",
        "truncated": directory / "truncated.pt",
        "empty": directory / "empty.pt",
        "not torch": directory / "notes.pt",
        "folder": directory,
    }
    files["truncated"].write_bytes(data[: len(data) // 2])
    files["empty"].write_bytes(b"")
    files["not torch"].write_text("hello\n")
    return files


@pytest.mark.parametrize("case", ["missing", "truncated", "empty", "not torch", "folder"])
def test_broken_file_is_exit_2_with_one_line_naming_it(tmp_path, saved, case):
    path = broken_files(tmp_path, saved)[case]
    for command in ("inspect", "verify"):
        result = invoke("checkpoint", command, str(path))
        assert result.exit_code == 2, result.stderr
        assert result.stderr.count("\n") == 1 and str(path) in result.stderr
        assert "Traceback" not in result.stderr + result.stdout


def test_truncated_file_through_the_real_cli_is_one_line(tmp_path, saved):
    path = broken_files(tmp_path, saved)["truncated"]
    result = run_cli("checkpoint", "inspect", str(path), timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: checkpoint {path} is truncated or corrupt and cannot be read (the zip archive "
        "torch.save writes is cut short: it has no central directory)"
    )


def flip_a_weight_byte(path: Path) -> None:
    """Change one byte of tensor data: torch still loads the file, the digest catches it."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_changed_bytes_fail_verify_and_resume_but_not_a_plain_load(tmp_path):
    path = tmp_path / "big.pt"
    atomic_save(training_payload() | {"extra": torch.ones(1_000_000)}, path)
    flip_a_weight_byte(path)
    safe_load(path)  # torch itself notices nothing
    result = invoke("checkpoint", "verify", str(path))
    assert result.exit_code == 1
    assert "sha256" in result.stderr and "changed after the save" in result.stderr
    with pytest.raises(DdpcliError, match="is corrupt: its SHA-256"):
        load_training_checkpoint(path, "cpu")


# --- 6. inspect, verify, convert ----------------------------------------------------------


def test_inspect_json_reports_what_the_checkpoint_holds(saved):
    result = invoke("checkpoint", "inspect", str(saved), "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["kind"] == "training" and report["resumable"]
    assert (report["epochs_done"], report["step"], report["world_size"]) == (1, 8, 2)
    assert report["config"]["arch"] == "tinycnn" and report["metrics"][0]["val_acc"] == 0.5
    assert report["model"]["ddp_prefix"] is False
    assert report["model"]["dtypes"] == {"float32": 17, "int64": 3}
    assert report["model"]["parameters"] == 6418  # BatchNorm running stats excluded
    assert report["size_bytes"] == saved.stat().st_size
    assert report["digest"]["status"] == "ok" and report["devices"] == {"cpu": report["tensors"]}


def test_inspect_table_for_people_on_stderr(saved):
    result = invoke("checkpoint", "inspect", str(saved))
    assert result.exit_code == 0 and result.stdout == ""
    for words in ("1 of 3 epochs done", "step 8", "tinycnn", "6,418", "float32", "sha256"):
        assert words in result.stderr
    # The settings that differ from the defaults, and what the run found; not the rest.
    config = result.stderr.split("config, beside the defaults (--json: all): ")[1]
    settings = dict(pair.split("=", 1) for pair in config.split() if "=" in pair)
    assert {"arch": "tinycnn", "epochs": "3", "image_size": "16", "cpu": "True"}.items() <= (
        settings.items()
    )
    assert "peak_lr" in settings
    assert not {"seed", "ema_decay", "powersgd_start_step", "keep_last"} & settings.keys()


def test_inspect_shows_the_ddp_prefix(tmp_path):
    path = tmp_path / "ddp.pt"
    atomic_save(training_payload(prefix="module.")["model"], path)
    report = json.loads(invoke("checkpoint", "inspect", str(path), "--json").stdout)
    assert report["kind"] == "state-dict" and report["model"]["ddp_prefix"] is True


def test_verify_passes_a_good_checkpoint(saved):
    result = invoke("checkpoint", "verify", str(saved), "--json")
    assert result.exit_code == 0, result.stderr
    checks = {check["check"]: check["status"] for check in json.loads(result.stdout)["checks"]}
    assert checks == dict.fromkeys(["safe load", "sha256", "finite", "model", "resumable"], "pass")


def test_verify_fails_on_a_non_finite_tensor(tmp_path):
    payload = training_payload()
    payload["model"]["fc.bias"][3] = float("nan")
    atomic_save(payload, tmp_path / "nan.pt")
    result = invoke("checkpoint", "verify", str(tmp_path / "nan.pt"))
    assert result.exit_code == 1
    assert "finite: model/fc.bias (1 NaN/inf)" in result.stderr


def test_verify_fails_when_the_model_rejects_the_state_dict(tmp_path):
    payload = training_payload()
    payload["model"]["fc.weight"] = torch.zeros(5, 32)
    del payload["model"]["fc.bias"]
    atomic_save(payload, tmp_path / "wrong.pt")
    result = invoke("checkpoint", "verify", str(tmp_path / "wrong.pt"))
    assert result.exit_code == 1
    assert "missing 1 key(s): fc.bias" in result.stderr
    assert "fc.weight is [5, 32], the model wants [10, 32]" in result.stderr


def test_convert_strips_the_ddp_prefix_for_torchvision(tmp_path):
    import torchvision

    source, out = tmp_path / "ddp.pt", tmp_path / "resnet18.pt"
    atomic_save(training_payload("resnet18", 10, prefix="module."), source)
    result = invoke("checkpoint", "convert", str(source), str(out), "--strip-ddp-prefix")
    assert result.exit_code == 0, result.stderr
    assert "torchvision.models.resnet18(num_classes=10)" in result.stderr
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(torch.load(out, weights_only=True))  # plain PyTorch, strict
    expected = safe_load(source)["model"]["module.fc.weight"]
    assert torch.equal(model.fc.weight.detach(), expected)


def test_convert_without_strip_warns_that_keys_keep_the_prefix(tmp_path):
    source = tmp_path / "ddp.pt"
    atomic_save(training_payload(prefix="module."), source)
    result = invoke("checkpoint", "convert", str(source), str(tmp_path / "out.pt"))
    assert result.exit_code == 0 and "--strip-ddp-prefix" in result.stderr
    assert next(iter(torch.load(tmp_path / "out.pt", weights_only=True))).startswith("module.")


def test_convert_weights_only_drops_optimizer_and_cannot_resume(saved, tmp_path):
    out = tmp_path / "weights.pt"
    result = invoke("checkpoint", "convert", str(saved), str(out), "--weights-only", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["layout"] == "weights-only checkpoint"
    payload = safe_load(out, check_digest=True)
    assert not {"optimizer", "scheduler", "rng"} & set(payload)
    assert payload["epoch"] == 1 and payload["config"]["arch"] == "tinycnn"
    assert invoke("checkpoint", "verify", str(out)).exit_code == 0
    with pytest.raises(DdpcliError, match="holds weights only"):
        load_training_checkpoint(out, "cpu")


def test_convert_refuses_to_overwrite_its_input(saved):
    result = invoke("checkpoint", "convert", str(saved), str(saved))
    assert result.exit_code == 2 and "OUT must differ" in result.stderr


# --- Resume helpers: refuse early and precisely ------------------------------------------


def resume_config(tmp_path: Path, resume: str) -> TrainConfig:
    return TrainConfig(resume=resume, out=tmp_path / "run")


def test_check_resume_source_refuses_before_any_worker_starts(tmp_path, saved):
    from ddpcli.checkpoint.schema import check_resume_source

    check_resume_source(resume_config(tmp_path, str(saved)))  # a good file passes
    check_resume_source(resume_config(tmp_path, "auto"))  # auto without last.pt: fresh start
    evil, marker = malicious_checkpoint(tmp_path)
    for source, reason in [(evil, "refused"), (tmp_path / "nope.pt", "does not exist")]:
        with pytest.raises(DdpcliError, match=reason):
            check_resume_source(resume_config(tmp_path, str(source)))
    assert not marker.exists()


def test_resume_from_a_folder_means_its_last_checkpoint(tmp_path, saved):
    from ddpcli.checkpoint.schema import find_resume_path

    last = tmp_path / "run" / "checkpoints" / "last.pt"
    last.parent.mkdir(parents=True)
    last.write_bytes(saved.read_bytes())
    assert find_resume_path(resume_config(tmp_path, str(tmp_path / "run"))) == last
    assert find_resume_path(resume_config(tmp_path, "auto")) == last


def test_resume_names_what_does_not_fit_the_model(saved):
    from ddpcli.checkpoint.loading import load_model_state
    from ddpcli.models.build import build_model

    with pytest.raises(DdpcliError, match=r"fc.weight is \[10, 32\], the model wants \[5, 32\]"):
        load_model_state(build_model("tinycnn", 5), safe_load(saved)["model"], saved)
    model = build_model("tinycnn", 10)
    load_model_state(model, training_payload(prefix="module.")["model"], saved)  # prefix dropped


def test_resume_warns_about_settings_that_change_the_result(saved):
    from ddpcli.checkpoint.schema import resume_warnings

    payload = safe_load(saved)
    config = payload["config"] | {"lr": 0.5, "out": "elsewhere"}
    (warning,) = resume_warnings(payload, config, world_size=2)
    assert "lr 0.2 -> 0.5" in warning and "out" not in warning  # tinycnn's default: 0.2
    assert resume_warnings(payload, payload["config"], 4) == []  # a new world is no warning


# --- Verify's options, digests that are missing or unreadable, unusable destinations ----------


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--arch", "nosuchnet"], "invalid --arch: unknown model 'nosuchnet'"),
        (["--num-classes", "-5"], "invalid --num-classes: a model has 1 class or more (got -5)"),
        (["--num-classes", "0"], "invalid --num-classes: a model has 1 class or more (got 0)"),
    ],
)
def test_verify_options_are_validated(saved, flags, words):
    result = invoke("checkpoint", "verify", str(saved), *flags)
    assert result.exit_code == 2, result.stderr
    assert words in result.stderr


def test_verify_without_a_digest_says_so_and_is_not_ok(saved):
    sha256_path(saved).unlink()
    result = invoke("checkpoint", "verify", str(saved))
    assert result.exit_code == 1
    assert f"no {saved.name}.sha256 beside the file" in result.stderr
    assert ": OK" not in result.stderr


def test_verify_with_a_garbage_digest_calls_it_unreadable(saved):
    sha256_path(saved).write_text("this is not a digest\n")
    result = invoke("checkpoint", "verify", str(saved))
    assert result.exit_code == 1
    assert "is unreadable: it holds no SHA-256 digest" in result.stderr
    assert "changed after the save" not in result.stderr
    assert digest_status(saved)["status"] == "unreadable"
    inspected = json.loads(invoke("checkpoint", "inspect", str(saved), "--json").stdout)
    assert inspected["digest"]["status"] == "unreadable"


def test_convert_into_a_folder_is_exit_2_naming_it(saved, tmp_path):
    folder = tmp_path / "converted"
    folder.mkdir()
    result = invoke("checkpoint", "convert", str(saved), str(folder))
    assert result.exit_code == 2, result.stderr
    assert f"invalid OUT: {folder} is a folder" in result.stderr
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    result = invoke("checkpoint", "convert", str(saved), str(blocked / "out.pt"))
    assert result.exit_code == 2 and f"{blocked} is a file" in result.stderr


def test_convert_onto_a_read_only_file_system_is_exit_2(saved, tmp_path):
    folder = tmp_path / "ro"
    result = run_on_read_only_mount(folder, f"checkpoint convert {saved} {folder}/out.pt", 60)
    assert result.returncode == 2, result.stderr
    assert "invalid OUT:" in result.stderr and "read-only file system" in result.stderr


# --- A custom model's arguments and its load line (34.2, 34.3) --------------------------------

MODS = """
from torch import nn


def tiny(num_classes, width=8):
    return nn.Sequential(
        nn.Conv2d(3, width, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes)
    )
"""


def custom_checkpoint(folder: Path, arch: str) -> Path:
    """A genuine checkpoint of `--arch ARCH --model-arg width=4` (mods.py's tiny)."""
    import importlib.util

    (folder / "mods.py").write_text(MODS)
    spec = importlib.util.spec_from_file_location("mods_for_the_test", folder / "mods.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    payload = training_payload()
    payload["model"] = module.tiny(10, width=4).state_dict()
    payload["config"].update(arch=arch, model_args={"width": 4})
    path = folder / "custom.pt"
    atomic_save(payload, path)
    return path


def test_verify_builds_a_custom_model_with_its_model_args(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    path = custom_checkpoint(tmp_path, "mods.py:tiny")
    result = invoke("checkpoint", "verify", str(path), "--arch", "mods.py:tiny", "--json")
    assert result.exit_code == 0, result.stderr
    (model,) = [c for c in json.loads(result.stdout)["checks"] if c["check"] == "model"]
    assert model == {
        "check": "model",
        "status": "pass",
        "detail": "mods.py:tiny(num_classes=10, width=4) accepts all 4 tensors",
    }


CUSTOM_ARCHS = {
    "mods:tiny": "from mods import tiny; tiny(num_classes=10, width=4).load_state_dict(",
    "mods.py:tiny": "from mods import tiny; tiny(num_classes=10, width=4).load_state_dict(",
    "{folder}/mods.py:tiny": "tiny = runpy.run_path('{folder}/mods.py')['tiny']; tiny(",
}
# Each load line run from its own folder, as a user would paste it there, in one fresh
# interpreter for all (an interpreter importing torch for each costs seconds): `mods` is
# forgotten between folders, and the working folder is the first place imports look.
RUN_EACH_LINE = """
import os, sys
for folder, line in {lines!r}:
    os.chdir(folder)
    sys.modules.pop("mods", None)
    exec("import torch; " + line, {{}})
"""


def test_convert_of_a_custom_model_prints_a_python_line_that_loads_it(tmp_path):
    lines = []
    for number, (arch, hint) in enumerate(CUSTOM_ARCHS.items()):
        folder = tmp_path / f"project{number}"
        folder.mkdir()
        arch, hint = arch.format(folder=folder), hint.format(folder=folder)
        path, out = custom_checkpoint(folder, arch), folder / "weights.pt"
        result = invoke("checkpoint", "convert", str(path), str(out), "--json")
        assert result.exit_code == 0, result.stderr
        line = json.loads(result.stdout)["load_hint"]
        assert hint in line
        lines.append((str(folder), line))
    loads = subprocess.run(
        [sys.executable, "-c", RUN_EACH_LINE.format(lines=lines)], cwd=tmp_path,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert loads.returncode == 0, loads.stderr[-2000:]


# --- Resume checks what verify checks (34.11), and the optimizer (34.15) ----------------------


def with_momentum(payload: dict, value: float) -> dict:
    """PAYLOAD as after some steps of SGD: a momentum buffer for the first parameter."""
    first = payload["model"]["features.0.0.weight"]
    payload["optimizer"]["state"] = {0: {"momentum_buffer": torch.full_like(first, value)}}
    return payload


def last_checkpoint(tmp_path: Path, payload: dict) -> Path:
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    atomic_save(payload, last)
    return last


@pytest.mark.parametrize("sidecar", ["deleted", "garbage"])
def test_resume_says_when_it_cannot_check_the_digest(tmp_path, capsys, sidecar):
    from ddpcli.checkpoint.schema import check_resume_source

    last = last_checkpoint(tmp_path, with_momentum(training_payload(), 0.5))
    if sidecar == "deleted":
        sha256_path(last).unlink()
    else:
        sha256_path(last).write_text("garbage\n")
    check_resume_source(resume_config(tmp_path, "auto"))  # resumable: a warning, no refusal
    warning = capsys.readouterr().err
    assert f"cannot check {last}" in " ".join(warning.split())
    assert ("no last.pt.sha256" if sidecar == "deleted" else "holds no SHA-256") in warning


def test_resume_refuses_non_finite_optimizer_state_without_a_digest(tmp_path, in_process):
    last = last_checkpoint(tmp_path, with_momentum(training_payload(), float("nan")))
    sha256_path(last).unlink()
    result = in_process("train", *TINY_TRAIN, "--out", str(tmp_path / "run"), "--resume", "auto")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    (warning,) = [line for line in lines if line.startswith("warning: cannot check")]
    assert "no last.pt.sha256" in warning
    assert lines[-1].startswith(f"error: cannot resume from {last}: it holds NaN or inf")
    assert "optimizer/state/0/momentum_buffer" in lines[-1]
    assert "Traceback" not in result.stderr


def test_resume_with_another_optimizer_is_exit_2_naming_both(tmp_path, saved, in_process):
    result = in_process(
        "train", *TINY_TRAIN, "--out", str(tmp_path / "run"), "--resume", str(saved),
        "--optimizer", "adamw",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert (
        f"cannot resume from {saved}: it was trained with --optimizer sgd, this run asks for "
        "--optimizer adamw" in result.stderr
    )
    assert "Traceback" not in result.stderr and "KeyError" not in result.stderr


def test_restoring_another_optimizers_state_is_refused_not_a_key_error(saved):
    from ddpcli.checkpoint.schema import check_optimizer_fits
    from ddpcli.models.build import build_model

    adamw = torch.optim.AdamW(build_model("tinycnn", 10).parameters())
    with pytest.raises(DdpcliError, match="--optimizer sgd, this run asks for --optimizer adamw"):
        check_optimizer_fits(safe_load(saved), adamw, saved)


# --- A full disk at save (34.18) --------------------------------------------------------------


class FullDisk:
    """A file on a disk that fills after LIMIT bytes, as the kernel reports it."""

    def __init__(self, handle, limit: int) -> None:
        self.handle, self.limit, self.written = handle, limit, 0

    def write(self, data) -> int:
        self.written += len(data)
        if self.written > self.limit:
            raise OSError(28, os.strerror(28))
        return self.handle.write(data)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()


def test_a_full_disk_at_save_says_so_and_keeps_the_previous_last(tmp_path, monkeypatch):
    writer = CheckpointWriter(TrainConfig(out=tmp_path / "run", keep_last=0), main_rank())
    writer.save(training_payload(), "epoch-0001.pt", is_best=False)
    last = writer.directory / "last.pt"
    before = last.read_bytes()
    real_fdopen = os.fdopen
    monkeypatch.setattr(
        files.os, "fdopen", lambda fd, mode: FullDisk(real_fdopen(fd, mode), limit=4096)
    )
    with pytest.raises(DdpcliError) as error:
        writer.save(training_payload() | {"step": 16}, "epoch-0002.pt", is_best=False)
    assert error.value.exit_code == 1
    assert "No space left on device" in error.value.message
    assert str(writer.directory) in error.value.message and "unexpected pos" not in str(error.value)
    monkeypatch.undo()
    assert last.read_bytes() == before and digest_status(last)["status"] == "ok"
    assert sorted(p.name for p in writer.directory.iterdir()) == ["last.pt", "last.pt.sha256"]


def test_a_run_whose_disk_fills_at_its_first_save_says_so(tmp_path):
    """The real thing: a 40 KB tmpfs as --out (a mount namespace of the run's own; needs root
    and unshare, else skipped)."""
    import shutil

    if not shutil.which("unshare") or os.geteuid() != 0:
        pytest.skip("needs unshare and root for a small tmpfs")
    out = tmp_path / "small"
    out.mkdir()
    flags = ["--nproc", "1", "--synthetic-size", "32", "--out", f"{out}/run"]
    train = " ".join(["train", *TINY_TRAIN, *flags])  # the last --nproc wins
    script = (
        f"mount -t tmpfs -o size=40k none {out} || exit 77; exec {sys.executable} -m ddpcli {train}"
    )
    result = run_bounded(["unshare", "-m", "sh", "-c", script], 180, clean_env())
    if result.returncode == 77:
        pytest.skip("cannot mount a tmpfs here")
    assert result.returncode == 1, result.stderr[-3000:]
    assert (
        f"error: rank 0: could not save a checkpoint in {out}/run/checkpoints: No space left on "
        "device; free space there" in result.stderr
    )
    assert "unexpected pos" not in result.stderr and "Traceback" not in result.stderr


# --- --init-from weights that are not finite (34.25) ------------------------------------------


def test_init_from_refuses_weights_that_hold_nan(tmp_path, in_process):
    weights = training_payload()["model"]
    weights["features.0.0.weight"][0, 0, 0, 0] = float("nan")
    torch.save(weights, tmp_path / "nan.pt")
    result = in_process(
        "train", *TINY_TRAIN, "--out", str(tmp_path / "run"), "--init-from",
        str(tmp_path / "nan.pt"), "--dry-run",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == (
        f"error: invalid --init-from: {tmp_path / 'nan.pt'} holds NaN or inf in "
        "features.0.0.weight (1 NaN/inf); these weights cannot train, take an earlier checkpoint"
    )


# --- Out of memory while loading onto a GPU (40.9) --------------------------------------------


@pytest.mark.parametrize(
    ("raised", "words"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "out of memory"),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), "CUDA error"),
    ],
)
def test_out_of_memory_while_loading_is_not_called_corrupt(saved, monkeypatch, raised, words):
    from ddpcli.checkpoint.init import load_initial_weights
    from ddpcli.models.build import build_model

    def load(*args, **kwargs):
        raise raised

    monkeypatch.setattr(torch, "load", load)
    for attempt in (
        lambda: load_training_checkpoint(saved, "cuda:0"),
        lambda: load_initial_weights(build_model("tinycnn", 10), saved, 10, False, "cuda:0"),
    ):
        with pytest.raises(DdpcliError) as error:
            attempt()
        assert error.value.exit_code == 1
        assert words in error.value.message and "corrupt" not in error.value.message
        assert f"loading {saved} onto cuda:0" in error.value.message
        assert "\n" not in error.value.message


def test_a_device_failure_inside_torch_load_comes_through_as_itself(saved):
    """The same through torch's own unpickler: storages are placed by map_location."""

    def out_of_memory(storage, location):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(DdpcliError) as error:
        safe_load(saved, map_location=out_of_memory)
    assert error.value.exit_code == 1
    assert error.value.message.startswith(f"out of memory loading {saved}: CUDA out of memory")
    assert "free that GPU's memory" in error.value.message


@pytest.mark.gpu
def test_out_of_memory_loading_onto_a_real_gpu(tmp_path):
    path = tmp_path / "big.pt"
    atomic_save({"model": {"weight": torch.zeros(256, 1024, 1024)}}, path)  # 1 GiB
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (256 << 20), dtype=torch.uint8, device="cuda")  # leave 256 MiB
    try:
        with pytest.raises(DdpcliError) as error:
            safe_load(path, map_location=torch.device("cuda", 0))
    finally:
        del hog
        torch.cuda.empty_cache()
    assert error.value.exit_code == 1 and "out of memory" in error.value.message
    assert "corrupt" not in error.value.message
