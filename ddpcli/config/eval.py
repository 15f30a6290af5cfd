"""`ddpcli eval`'s configuration: the checkpoint, the data it is measured on, what may be
overridden of the model and its view, the outputs, and the launch settings `train` has.

A setting left at None is the checkpoint's own (its arch, data set, image size, view,
precision, batch): `ddpcli.evaluation.plan` fills it in from the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from ddpcli.config.common import (
    PER_NODE,
    Backend,
    CommandConfig,
    DatasetName,
    GpuList,
    Membership,
    Precision,
    RdzvBackend,
    check_membership,
    check_node_rank,
    given,
    split_nnodes,
    validated,
)
from ddpcli.config.data import DataLocation
from ddpcli.factories import is_factory_spec

Split = Literal["val", "train", "test"]
Weights = Literal["ema", "raw"]
EVAL_DATASETS = (*get_args(DatasetName), "shards")


class EvalConfig(Membership, CommandConfig):
    """Everything `ddpcli eval` needs. Field names are the flags with `_` for `-`."""

    checkpoint: Annotated[Path, PER_NODE]
    # data: the checkpoint's data set unless named; DIR/SPLIT (or DIR itself) for folders
    data_dir: Annotated[DataLocation | None, PER_NODE] = None
    dataset: str | None = None
    split: Split = "val"
    # the model and its view: the checkpoint's unless given
    weights: Weights | None = None
    arch: str | None = None
    trust_checkpoint_code: bool = False
    image_size: int | None = Field(None, ge=8, le=1024)
    val_resize_size: int | None = Field(None, ge=8, le=2048)
    val_crop_size: int | None = Field(None, ge=8, le=1024)
    precision: Precision | None = None
    per_gpu_batch: int | None = Field(None, ge=1)
    workers: Annotated[int | None, PER_NODE] = Field(
        None, ge=0, description="DataLoader workers per rank"
    )
    # outputs
    out: Annotated[Path | None, PER_NODE] = None
    predictions: bool = Field(
        False, description="also write predictions.csv: each image's label and top-5 classes"
    )
    flight_recorder: bool = Field(
        True,
        description="torch's flight recorder in every rank: when ranks stop agreeing, a "
        "verdict naming the rank, the collective and the line that issued it",
    )
    # processes, devices and nodes, as `ddpcli train` takes them
    gpus: Annotated[GpuList, PER_NODE] = None
    cpu: bool = False
    nproc: int | None = Field(None, ge=1, le=1024)
    backend: Backend = "auto"
    nnodes: int = Field(1, ge=1)
    min_nnodes: int | None = Field(None, ge=1)
    node_rank: Annotated[int, PER_NODE] = Field(0, ge=0)
    master_addr: Annotated[str, PER_NODE] = "127.0.0.1"
    master_port: Annotated[int | None, PER_NODE] = Field(None, ge=1, le=65535)
    rdzv_backend: RdzvBackend | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    init_method: Annotated[str | None, PER_NODE] = None
    ifname: Annotated[str | None, PER_NODE] = None
    timeout: Annotated[float, PER_NODE] = Field(
        300.0, ge=1, description="seconds for init and every collective"
    )
    max_restarts: int = Field(0, ge=0)

    @field_validator("dataset")
    @classmethod
    def _dataset_name(cls, value: str | None) -> str | None:
        if value is None or value in EVAL_DATASETS or is_factory_spec(value):
            return value
        raise ValueError(
            "use synthetic, stl10, imagefolder, shards, or your own data set as "
            "pkg.module:factory (docs/custom.md)"
        )

    @model_validator(mode="before")
    @classmethod
    def _nnodes_range(cls, data: Any) -> Any:
        return split_nnodes(data)

    @model_validator(mode="after")
    def _consistent(self) -> EvalConfig:
        check_node_rank(self.node_rank, self.nnodes)
        check_membership(self.min_nnodes, self.nnodes, self.rdzv_backend, self.rdzv_endpoint)
        if self.cpu and self.gpus:
            raise ValueError("invalid --cpu: --cpu and --gpus exclude each other; pick one")
        if self.dataset in ("stl10", "imagefolder", "shards") and self.data_dir is None:
            raise ValueError(f"invalid --data-dir: --dataset {self.dataset} needs --data-dir DIR")
        return self

    @property
    def uses_gpus(self) -> bool:
        return not self.cpu and bool(self.gpus)

    @property
    def nproc_per_node(self) -> int:
        return len(self.gpus) if self.uses_gpus and self.gpus else (self.nproc or 2)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def resolved_out(self) -> Path:
        """--out, else a folder beside the checkpoint: `eval-best-val` for best.pt's val split."""
        if self.out is not None:
            return self.out
        return self.checkpoint.parent / f"eval-{self.checkpoint.stem}-{self.split}"


def build_eval_config(flags: dict[str, Any]) -> EvalConfig:
    """Flags left at None were not given: the field's default (or the checkpoint's) stands."""
    return validated(EvalConfig, given(flags))
