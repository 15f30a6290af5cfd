"""`ddpcli launch`'s configuration: which script (or module) to run, on how many processes
and nodes, and how the nodes meet. torchrun's flag spellings land on the same fields."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ddpcli.config.common import (
    GpuList,
    Membership,
    RdzvBackend,
    check_membership,
    check_node_rank,
    given,
    nproc_spec,
    pod_defaults,
    split_nnodes,
    validated,
    with_origins,
)
from ddpcli.errors import DdpcliError

# Below a second no rank can even join: the rendezvous is bounded by --timeout.
MIN_TIMEOUT_S = 1.0


class ScriptLaunchConfig(Membership, BaseModel):
    """Everything `ddpcli launch` needs. Field names are the flags with `_` for `-`."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(min_length=1)  # SCRIPT.py, or MODULE with `module`
    module: bool = False
    script_args: list[str] = Field(default_factory=list)
    gpus: GpuList = None
    nproc: int | None = Field(None, ge=1, le=1024)
    nnodes: int = Field(1, ge=1)  # the most nodes; `--nnodes MIN:MAX` sets both
    min_nnodes: int | None = Field(None, ge=1)
    node_rank: int = Field(0, ge=0)
    master_addr: str = Field("127.0.0.1", min_length=1)
    master_port: int | None = Field(None, ge=1, le=65535)
    rdzv_backend: RdzvBackend | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    standalone: bool = False
    ifname: str | None = None
    max_restarts: int = Field(0, ge=0)
    timeout: float = Field(300.0, ge=MIN_TIMEOUT_S, description="seconds for the rendezvous")
    log_dir: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _nnodes_range(cls, data: Any) -> Any:
        return split_nnodes(data)

    @model_validator(mode="after")
    def _consistent(self) -> ScriptLaunchConfig:
        check_node_rank(self.node_rank, self.nnodes)
        check_membership(self.min_nnodes, self.nnodes, self.rdzv_backend, self.rdzv_endpoint)
        if self.gpus and self.nproc is not None and self.nproc != len(self.gpus):
            raise ValueError(
                f"invalid --nproc: {self.nproc} processes, but --gpus lists {len(self.gpus)} "
                "GPUs (one process each); give one of them"
            )
        if self.standalone and self.nnodes > 1:
            raise ValueError(
                "invalid --standalone: it means one node, but --nnodes is "
                f"{self.nnodes}; drop one of them"
            )
        return self

    @property
    def nproc_per_node(self) -> int:
        """Set by `ddpcli.launch.resolve_script_launch` when neither flag is given."""
        if self.gpus:
            return len(self.gpus)
        if self.nproc is None:
            raise RuntimeError("ScriptLaunchConfig.nproc read before it was resolved")
        return self.nproc


def build_launch_config(
    flags: dict[str, Any], environ: Mapping[str, str] | None = None
) -> ScriptLaunchConfig:
    """A pod's PET_* variables < flags (left at None: not given); exit 2 with one line per
    problem naming the flag, and the PET_* variable it came from."""
    env = os.environ if environ is None else environ
    from_pod, pod_origins = pod_defaults(env, launch_nproc_settings)
    from_flags = given(flags)
    if isinstance(from_flags.get("nproc"), str):  # torchrun's --nproc-per-node auto|gpu|cpu|N
        settings = launch_nproc_settings(from_flags.pop("nproc"), "--nproc")
        from_pod.pop("nproc", None)  # a flag wins, even `auto`
        from_flags.update(settings)
    try:
        return validated(ScriptLaunchConfig, {**from_pod, **from_flags})
    except DdpcliError as error:
        origins = {name: pod for name, pod in pod_origins.items() if name not in from_flags}
        raise with_origins(error, origins) from None


def launch_nproc_settings(text: str, source: str = "PET_NPROC_PER_NODE") -> dict[str, Any]:
    """PET_NPROC_PER_NODE for `ddpcli launch`: N processes, cpu: one per core; auto and gpu:
    one per GPU (else 2, ddpcli's default; torchrun's auto would start one per core)."""
    spec = nproc_spec(text, source)
    if isinstance(spec, int):
        return {"nproc": spec}
    return {"nproc": os.cpu_count() or 1} if spec == "cpu" else {}
