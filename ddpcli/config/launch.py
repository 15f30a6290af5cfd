"""`ddpcli launch`'s configuration: which script (or module) to run, on how many processes
and nodes, and how the nodes meet. torchrun's flag spellings land on the same fields."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ddpcli.config.common import GpuList, check_node_rank, given, validated

# Below a second no rank can even join: the rendezvous is bounded by --timeout.
MIN_TIMEOUT_S = 1.0


class ScriptLaunchConfig(BaseModel):
    """Everything `ddpcli launch` needs. Field names are the flags with `_` for `-`."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(min_length=1)  # SCRIPT.py, or MODULE with `module`
    module: bool = False
    script_args: list[str] = Field(default_factory=list)
    gpus: GpuList = None
    nproc: int | None = Field(None, ge=1, le=1024)
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    master_addr: str = Field("127.0.0.1", min_length=1)
    master_port: int | None = Field(None, ge=1, le=65535)
    standalone: bool = False
    ifname: str | None = None
    max_restarts: int = Field(0, ge=0)
    timeout: float = Field(300.0, ge=MIN_TIMEOUT_S, description="seconds for the rendezvous")
    log_dir: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ScriptLaunchConfig:
        check_node_rank(self.node_rank, self.nnodes)
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


def build_launch_config(flags: dict[str, Any]) -> ScriptLaunchConfig:
    """Flags left at None were not given; exit 2 with one line per problem naming the flag."""
    return validated(ScriptLaunchConfig, given(flags))
