"""Kubernetes pods started by Kubeflow (PyTorchJob v1, Trainer v2's TrainJob): the operator
runs the pod's command with torchrun's `PET_<FLAG>` variables, which torchrun reads as the
defaults of its flags (torch/distributed/argparse_util.py, action `env`).

Such a pod is not yet a worker: it is where ddpcli starts its workers, as torchrun would.
The operator's pod-level RANK (the pod index) and WORLD_SIZE (pods x processes) beside them
describe pods, never this process's rank. Once a launcher made this process a worker
(LOCAL_RANK, TORCHELASTIC_RUN_ID), the PET_* variables it inherited are the pod's, not its.
"""

from __future__ import annotations

from collections.abc import Mapping

# PET_<FLAG> -> the flag it is the default of, as torchrun names them.
PET_FLAGS = {
    "PET_NPROC_PER_NODE": "--nproc-per-node",
    "PET_NNODES": "--nnodes",
    "PET_NODE_RANK": "--node-rank",
    "PET_MASTER_ADDR": "--master-addr",
    "PET_MASTER_PORT": "--master-port",
    "PET_RDZV_ENDPOINT": "--rdzv-endpoint",
    "PET_RDZV_ID": "--rdzv-id",
    "PET_RDZV_BACKEND": "--rdzv-backend",
    "PET_MAX_RESTARTS": "--max-restarts",
}
# Set by a launcher in each worker it starts; a pod's own command has neither.
WORKER_VARIABLES = ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")


def made_a_worker(env: Mapping[str, str]) -> bool:
    return any(name in env for name in WORKER_VARIABLES)


def pet_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The PET_* flag defaults this pod's command was given; {} when none, or when a
    launcher already made this process one of its workers."""
    if made_a_worker(env):
        return {}
    return {name: env[name] for name in PET_FLAGS if env.get(name, "") != ""}


def describe(variables: Mapping[str, str]) -> str:
    """`Kubernetes pod (PET_NNODES=2 PET_NODE_RANK=1 ...)`: where a pod's world came from."""
    shown = " ".join(f"{name}={value}" for name, value in variables.items())
    return f"Kubernetes pod ({shown})"
