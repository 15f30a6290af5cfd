"""Kubernetes pods (Kubeflow PyTorchJob v1, Trainer v2 TrainJob): `ddpcli train` started as
the pod's command reads torchrun's PET_* variables as its flag defaults, and never takes
the operator's pod-level RANK/WORLD_SIZE for a worker's."""

from __future__ import annotations

import time

import pytest
from conftest import free_port, read_metrics, run_cli

from ddpcli.config import build_launch_config, build_train_config
from ddpcli.environments import read_launcher_env
from ddpcli.errors import DdpcliError

TINY = [
    "--cpu", "--arch", "tinycnn", "--image-size", "16", "--per-gpu-batch", "8",
    "--synthetic-size", "96", "--epochs", "1",
]  # fmt: skip


def v1_pod(port: int) -> dict[str, str]:
    """What the training operator gives pod 0 of a one-pod PyTorchJob, nprocPerNode 3."""
    return {
        "RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "PET_NPROC_PER_NODE": "3", "PET_NNODES": "1", "PET_NODE_RANK": "0",
        "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port),
    }  # fmt: skip


def v2_pod(port: int) -> dict[str, str]:
    """What Trainer v2's torch runtime gives a TrainJob's node: PET_* only."""
    return {
        "PET_NNODES": "1", "PET_NPROC_PER_NODE": "3", "PET_NODE_RANK": "0",
        "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port),
    }  # fmt: skip


def test_the_operators_rank_is_a_pods_not_a_workers():
    assert read_launcher_env(v1_pod(29500)) is None
    worker = {**v1_pod(29500), "LOCAL_RANK": "1", "RANK": "1", "TORCHELASTIC_RUN_ID": "x"}
    found = read_launcher_env(worker)
    assert found is not None and found.rank == 1


@pytest.mark.parametrize("pod", [v1_pod, v2_pod])
def test_pet_variables_are_the_flag_defaults(pod):
    cfg = build_train_config({}, None, pod(23456))
    assert (cfg.nproc, cfg.nnodes, cfg.node_rank, cfg.master_port) == (3, 1, 0, 23456)
    assert cfg.world_from is not None and "PET_NPROC_PER_NODE=3" in cfg.world_from


def test_a_flag_wins_over_pet():
    env = {**v2_pod(23456), "PET_NNODES": "2:4", "PET_RDZV_ENDPOINT": "node0:29400"}
    cfg = build_train_config({"nproc": 2, "nnodes": "3"}, None, env)
    assert (cfg.nproc, cfg.nnodes, cfg.min_nnodes, cfg.elastic) == (2, 3, None, False)
    launch = build_launch_config({"target": "x.py", "nproc": 1}, env)
    assert (launch.nproc, launch.min_nnodes, launch.nnodes, launch.elastic) == (1, 2, 4, True)
    assert launch.rendezvous_address(29500) == ("node0", 29400)


def test_a_bad_pet_variable_names_itself():
    with pytest.raises(DdpcliError, match=r"--nnodes from PET_NNODES=two") as raised:
        build_train_config({}, None, {"PET_NNODES": "two"})
    assert raised.value.exit_code == 2
    with pytest.raises(DdpcliError, match="invalid PET_NPROC_PER_NODE"):
        build_train_config({}, None, {"PET_NPROC_PER_NODE": "many"})


@pytest.mark.parametrize("pod", [v1_pod, v2_pod])
def test_a_pod_trains_as_the_world_its_variables_describe(tmp_path, pod):
    out = tmp_path / "run"
    done = run_cli("train", *TINY, "--out", str(out), env=pod(free_port()), timeout=150)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "world from Kubernetes pod (" in done.stderr
    assert "world size 3 " in done.stderr
    assert read_metrics(out)[-1]["world_size"] == 3


def test_node_1_whose_master_never_comes_exits_1_naming_it(tmp_path):
    port = free_port()
    env = {**v2_pod(port), "PET_NNODES": "2", "PET_NODE_RANK": "1"}
    started = time.monotonic()
    done = run_cli(
        "train", *TINY, "--out", str(tmp_path / "run"), "--timeout", "4", env=env, timeout=90
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert time.monotonic() - started < 60
    assert f"could not reach the master at 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr
