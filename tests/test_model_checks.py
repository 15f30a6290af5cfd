"""A model DDP cannot train, found before any worker starts (exit 2, one line): no trainable
parameters, or parameters that take no part in the loss. `--find-unused-parameters` trains
the latter; a model that leaves some out only later, in training, is told the same."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run_cli

MODELS = """
import torch
from torch import nn


def frozen(num_classes):
    model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, num_classes))
    model.requires_grad_(False)
    return model


class NoParameters(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.num_classes = num_classes

    def forward(self, images):
        return images.mean(dim=(2, 3))[:, :1].repeat(1, self.num_classes)


def no_parameters(num_classes):
    return NoParameters(num_classes)


class Unused(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(3, num_classes)
        self.aux = nn.Linear(3, num_classes)  # built, never called

    def forward(self, images):
        return self.head(self.body(images))


def unused(num_classes):
    return Unused(num_classes)


class UnusedLater(Unused):
    \"\"\"Uses aux in its first forward passes only (pre-flight sees it used).\"\"\"

    calls = 0

    def forward(self, images):
        self.calls += 1
        features = self.body(images)
        if self.calls <= 2:
            return self.head(features) + 0 * self.aux(features)
        return self.head(features)


def unused_later(num_classes):
    return UnusedLater(num_classes)
"""

TINY = [
    "train", "--cpu", "--nproc", "2", "--image-size", "16", "--per-gpu-batch", "8",
    "--synthetic-size", "64", "--epochs", "1",
]  # fmt: skip


@pytest.fixture
def project(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "nets.py").write_text(textwrap.dedent(MODELS))
    # A check run in this process imports nets from the project: this test's, not an earlier's.
    monkeypatch.delitem(sys.modules, "nets", raising=False)
    yield tmp_path
    sys.modules.pop("nets", None)


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        ("frozen", "nets:frozen has no trainable parameters (all 2 parameter tensors are frozen"),
        ("no_parameters", "nets:no_parameters has no parameters"),
    ],
)
def test_a_model_with_nothing_to_train_exits_2_before_launch(project, factory, words, in_process):
    # Refused in the launcher before any worker starts: in this process.
    result = in_process(
        *TINY, "--arch", f"nets:{factory}", "--out", str(project / "run"), cwd=project
    )
    assert result.returncode == 2, result.stderr
    assert f"error: invalid --arch: {words}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "DistributedDataParallel" not in result.stderr and "rank" not in result.stderr


def test_unused_parameters_exit_2_before_launch_naming_them_and_the_flag(project, in_process):
    result = in_process(*TINY, "--arch", "nets:unused", "--out", str(project / "run"), cwd=project)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    line = result.stderr.strip()
    assert "invalid --arch: nets:unused has parameters that take no part in the loss" in line
    assert "aux.weight, aux.bias" in line and "--find-unused-parameters" in line
    assert not (project / "run" / "metrics.jsonl").exists()


def test_find_unused_parameters_trains_such_a_model(project):
    out = project / "run"
    result = run_cli(
        *TINY, "--arch", "nets:unused", "--find-unused-parameters", "--out", str(out),
        cwd=project, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["find_unused_parameters"] is True
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_parameters_left_out_only_in_training_are_named_with_the_flag(project):
    out = project / "run"
    result = run_cli(*TINY, "--arch", "nets:unused_later", "--out", str(out), cwd=project)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "--find-unused-parameters" in result.stderr
    assert "find_unused_parameters=True" not in result.stderr  # DDP's advice, for its API
