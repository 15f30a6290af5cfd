"""Your own model and data: `--arch pkg.module:factory`, `--model-arg`, `--dataset
pkg.module:factory`, `--init-from`, `--optimizer adamw`, timm. The user's code is a module
each test writes into its temporary folder, and the command runs from there, as a user
runs it from their project."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, read_metrics, run_cli

MODEL_FILE = """
import torch
from torch import nn


class PatchNet(nn.Module):
    def __init__(self, num_classes, width=8):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, images):
        return self.head(self.body(images))


def patchnet(num_classes, width=8):
    return PatchNet(num_classes, width)


def not_a_module(num_classes):
    return "a string"


def wrong_width(num_classes):
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, num_classes + 1))


def raises(num_classes):
    raise RuntimeError("the factory broke")


NOT_CALLABLE = 3
"""

TINY = ["--cpu", "--nproc", "2", "--image-size", "16", "--per-gpu-batch", "8"]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project folder holding their model module."""
    (tmp_path / "mymodels.py").write_text(textwrap.dedent(MODEL_FILE))
    (tmp_path / "broken.py").write_text("import a_package_that_is_not_there\n")
    return tmp_path


def run_in(project: Path, *args: str, timeout: float = 60):
    """`python -m ddpcli ARGS` from the user's project folder (this checkout's ddpcli)."""
    return run_cli(*args, timeout=timeout, cwd=project, env={"PYTHONPATH": str(REPO)})


def import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_a_custom_model_trains_and_its_checkpoint_loads_back_into_the_users_class(project):
    out = project / "run"
    result = run_in(
        project, "train", *TINY, "--arch", "mymodels:patchnet", "--model-arg", "width=6",
        "--synthetic-size", "64", "--epochs", "1", "--out", str(out), "--json",
        timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mymodels:patchnet on synthetic" in result.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["arch"] == "mymodels:patchnet" and config["model_args"] == {"width": 6}
    assert read_metrics(out)[0]["world_size"] == 2

    converted = project / "weights.pt"
    convert = run_in(
        project, "checkpoint", "convert", str(out / "checkpoints" / "last.pt"), str(converted),
        timeout=60,
    )  # fmt: skip
    assert convert.returncode == 0, convert.stderr
    assert "mymodels:patchnet(num_classes=10, **model_args)" in convert.stdout + convert.stderr
    import torch

    user_module = import_file(project / "mymodels.py", "mymodels_loaded_back")
    model = user_module.PatchNet(num_classes=10, width=6)
    model.load_state_dict(torch.load(converted, weights_only=True))  # strict: every key fits


def test_dry_run_builds_the_model_and_names_its_class_and_size(project):
    result = run_in(
        project, "train", "--cpu", "--arch", "mymodels.py:patchnet", "--model-arg", "width=4",
        "--dry-run", "--json", "--out", str(project / "run"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["model_class"].endswith("PatchNet")
    # conv 3*4*9 + 4, BN 2*4, linear 4*10 + 10
    assert shown["parameters"] == 108 + 4 + 8 + 50
    assert shown["model_args"] == {"width": 4}


@pytest.mark.parametrize(
    ("arch", "words"),
    [
        ("broken:make", "invalid --arch: no module 'a_package_that_is_not_there' (importing broken)"),
        ("nowhere.models:make", "invalid --arch: no module 'nowhere'"),
        ("mymodels:missing", "invalid --arch: mymodels has no attribute 'missing'"),
        ("mymodels:NOT_CALLABLE", "is of type int, not a callable"),
        ("mymodels:not_a_module", "returned a value of type str, not a torch.nn.Module"),
        ("mymodels:wrong_width", "(batch, num_classes) = (2, 10) for 2 images; it returned (2, 11)"),
        ("mymodels:raises", "mymodels:raises(num_classes=10) raised RuntimeError: the factory broke"),
        ("nothere.py:make", "invalid --arch: nothere.py does not exist"),
        ("timm:resnet18", "timm models need timm, which is not installed; pip install"),
    ],
)  # fmt: skip
def test_each_bad_model_factory_exits_2_before_any_worker_starts(project, arch, words):
    out = project / "run"
    result = run_in(project, "train", *TINY, "--arch", arch, "--out", str(out))
    assert result.returncode == 2, result.stderr
    assert words in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (out / "config.json").exists()  # no worker ever ran


def test_model_args_are_toml_values_and_refused_when_malformed(project):
    from ddpcli.config import build_train_config

    cfg = build_train_config(
        {"model_args": ["depth=4", "rate=0.5", "act=relu", "sizes=[1, 2]", "bias=false"]}, None
    )
    assert cfg.model_args == {
        "depth": 4,
        "rate": 0.5,
        "act": "relu",
        "sizes": [1, 2],
        "bias": False,
    }
    bad = run_in(
        project, "train", "--cpu", "--arch", "mymodels:patchnet", "--model-arg", "width", "--dry-run",
        timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "invalid --model-arg: give KEY=VALUE" in bad.stderr
    unknown = run_in(
        project, "train", "--cpu", "--arch", "tinycnn", "--model-arg", "depth=3", "--dry-run",
        timeout=60,
    )  # fmt: skip
    assert unknown.returncode == 2
    assert "invalid --model-arg for --arch tinycnn" in unknown.stderr and "depth" in unknown.stderr
