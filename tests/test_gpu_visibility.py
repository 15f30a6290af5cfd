"""CUDA_VISIBLE_DEVICES already set (by a user, or a scheduler without device cgroups): a
run uses only the GPUs it grants, `--gpus` picks among them, and the workers number GPUs
as nvidia-smi does. A fake `nvidia-smi` on PATH stands in for a four-GPU machine."""

import json
import os

import pytest
from conftest import LAUNCHER_VARIABLES
from typer.testing import CliRunner

from ddpcli.cli import app
from ddpcli.launcher.engine import worker_environment

UUIDS = ["GPU-0a", "GPU-1b", "GPU-2c", "GPU-3d"]
FAKE_NVIDIA_SMI = """#!/bin/sh
if [ "$1" = "-L" ]; then
{lines}
else
{csv}
fi
"""


@pytest.fixture
def four_gpus(tmp_path, monkeypatch):
    """A machine whose nvidia-smi lists GPUs 0..3; no launcher, CUDA_VISIBLE_DEVICES unset."""
    lines = "\n".join(f'echo "GPU {i}: NVIDIA H100 (UUID: {u})"' for i, u in enumerate(UUIDS))
    csv = "\n".join(f'echo "{i}, NVIDIA H100, 81559, {u}"' for i, u in enumerate(UUIDS))
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir()
    script.write_text(FAKE_NVIDIA_SMI.format(lines=lines, csv=csv))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}:{os.environ['PATH']}")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # torch can use them
    for name in (*LAUNCHER_VARIABLES, "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def dry_run(*flags: str):
    return CliRunner().invoke(app, ["train", *flags, "--dry-run", "--json"])


def planned_gpus(*flags: str) -> list[int] | None:
    result = dry_run(*flags)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    return None if document["cpu"] else document["gpus"]


def test_without_the_variable_every_gpu_is_used(four_gpus):
    assert planned_gpus() == [0, 1, 2, 3]


def test_a_granted_set_is_the_default(four_gpus):
    four_gpus.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert planned_gpus() == [2, 3]  # not the other people's GPUs 0 and 1


def test_gpus_picks_among_the_granted_ones_by_nvidia_smi_index(four_gpus):
    four_gpus.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert planned_gpus("--gpus", "3") == [3]
    refused = dry_run("--gpus", "0")
    assert refused.exit_code == 2
    assert "invalid --gpus: GPU 0 is not one that CUDA_VISIBLE_DEVICES=2,3 grants" in (
        refused.stderr
    )
    assert "Traceback" not in refused.output


def test_gpu_uuids_are_read_as_their_nvidia_smi_index(four_gpus):
    four_gpus.setenv("CUDA_VISIBLE_DEVICES", f"{UUIDS[3]},{UUIDS[1]}")
    assert planned_gpus() == [3, 1]


@pytest.mark.parametrize("value", ["", "-1"])
def test_a_variable_that_hides_every_gpu_means_the_cpu(four_gpus, value):
    four_gpus.setenv("CUDA_VISIBLE_DEVICES", value)
    assert planned_gpus() is None


def test_an_entry_that_is_no_gpu_is_refused_in_one_line(four_gpus):
    four_gpus.setenv("CUDA_VISIBLE_DEVICES", "MIG-abc")
    result = dry_run()
    assert result.exit_code == 2
    assert "'MIG-abc' is not a GPU index or UUID that nvidia-smi lists" in result.stderr


def test_workers_number_gpus_in_nvidia_smi_order():
    env = worker_environment([2, 3], nproc_per_node=2)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # CUDA's default puts the fastest first


def test_a_granted_gpu_that_does_not_exist_is_refused(four_gpus):
    four_gpus.setenv("CUDA_VISIBLE_DEVICES", "1,7")
    result = dry_run()
    assert result.exit_code == 2
    assert "CUDA_VISIBLE_DEVICES=1,7 names GPU 7, which does not exist" in result.stderr
