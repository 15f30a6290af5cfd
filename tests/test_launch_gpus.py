"""`ddpcli launch --gpus` on GPUs torch cannot use: exit 2 before any worker, in the words
`ddpcli train` uses (ddpcli.launcher.resolve.check_torch_sees_gpus), in this process."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def node_whose_gpus_torch_cannot_use(monkeypatch):
    """nvidia-smi lists 8 GPUs with driver 535; torch is a CUDA 13 build that sees none."""
    from ddpcli import machine
    from ddpcli.launcher import resolve

    monkeypatch.setattr(machine, "physical_gpu_count", lambda: 8)
    monkeypatch.setattr(resolve, "nvidia_driver_version", lambda: "535.104.05")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def refusal(result) -> str:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_launch_refuses_gpus_torch_cannot_use_as_train_does(
    in_process, node_whose_gpus_torch_cannot_use, tmp_path
):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('no worker may start')\n")
    launch = refusal(in_process("launch", "--gpus", "0", str(script), cwd=tmp_path))
    train = refusal(in_process("train", "--gpus", "0", "--dry-run", "--out", str(tmp_path / "run")))
    problem = "(CUDA 13.0) cannot use the 1 GPU(s) nvidia-smi lists"
    assert problem in launch and "driver 535.104.05" in launch and "580 or newer" in launch
    assert launch.split("; ")[0] == train.split("; ")[0]  # the same problem, the same words
    assert launch.endswith("or run CPU processes with --nproc N without --gpus")
