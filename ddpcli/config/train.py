"""`ddpcli train`'s configuration: the TrainConfig schema, recipes, and the one place that
turns flags, a recipe and ddpcli's own environment variables into it.

Precedence: built-in defaults < recipe file < command-line flags. `ddpcli.resolve` then
fills every "auto" value from the machine, so `config.json` holds what really ran.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ddpcli.config.common import (
    Backend,
    DatasetName,
    GpuList,
    Precision,
    check_node_rank,
    given,
    validated,
)
from ddpcli.errors import usage_error

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# DDPCLI_TRACE_SAMPLES=PATH: each rank appends the sample indices of every training batch it
# is handed to PATH.rankN, one JSON line per batch. A debugging aid, and the evidence the
# resume tests use that no sample is trained twice or missed (docs/checkpoints.md).
TRACE_SAMPLES_VARIABLE = "DDPCLI_TRACE_SAMPLES"


class TrainConfig(BaseModel):
    """Everything `ddpcli train` needs. Field names are the flags with `_` for `-`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # data
    dataset: DatasetName = "synthetic"
    data_dir: Path | None = None
    download: bool = False
    image_size: int | None = Field(None, ge=8, le=1024)
    synthetic_size: int = Field(4096, ge=16, description="training images of the synthetic set")
    data_path: Literal["auto", "device", "loader"] = "auto"
    workers: int | None = Field(None, ge=0, description="DataLoader workers per rank")
    skip_bad_images: bool = Field(
        False,
        description="leave out image files that cannot be decoded (counted, listed in "
        "summary.json) instead of stopping; the loader path then decodes each image once "
        "before training to find them",
    )
    augment: Literal["auto", "rrc", "crop-flip", "none"] = "auto"
    # model and optimisation
    arch: str | None = None
    epochs: int = Field(5, ge=1)
    per_gpu_batch: int = Field(64, ge=1)
    accumulate: int = Field(1, ge=1)
    lr: float = Field(0.1, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    warmup_epochs: float = Field(1.0, ge=0)
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    seed: int = Field(0, ge=0)
    precision: Precision = "auto"
    compile: bool = False
    max_steps: int | None = Field(None, ge=1)
    # processes and devices
    gpus: GpuList = None
    cpu: bool = False
    nproc: int | None = Field(None, ge=1, le=1024)
    backend: Backend = "auto"
    strategy: Literal["ddp", "dp", "balanced-dp"] = "ddp"
    gpu0_batch: int | None = Field(None, ge=1)
    bucket_cap_mb: float = Field(
        25.0, gt=0, description="DDP gradient bucket size (MB): fewer, larger all-reduces"
    )
    # multi-node
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    master_addr: str = "127.0.0.1"
    master_port: int | None = Field(None, ge=1, le=65535)
    init_method: str | None = None
    ifname: str | None = None
    timeout: float = Field(300.0, gt=0, description="seconds for init and every collective")
    max_restarts: int = Field(0, ge=0)
    # outputs
    out: Path | None = None
    resume: str | None = None
    save_every_steps: int | None = Field(None, ge=1)
    keep_last: int = Field(3, ge=0)
    log_dir: Path | None = None
    log_every: int = Field(10, ge=1, description="steps between progress lines")
    # debugging: each rank appends the sample indices of every training batch to PATH.rankN
    trace_samples: Path | None = None

    @field_validator("init_method")
    @classmethod
    def _init_method_scheme(cls, value: str | None) -> str | None:
        if value is None or value == "env://":
            return value
        if re.fullmatch(r"tcp://[^:/\s]+:\d{1,5}", value):
            port = int(value.rsplit(":", 1)[1])
            if not 1 <= port <= 65535:
                raise ValueError(f"port {port} is out of range 1-65535")
            return value
        if re.fullmatch(r"file:///\S+", value):
            return value
        raise ValueError("use env://, tcp://HOST:PORT or file:///ABSOLUTE/PATH")

    @field_validator("resume")
    @classmethod
    def _resume_value(cls, value: str | None) -> str | None:
        return None if value in (None, "", "none") else value

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        check_node_rank(self.node_rank, self.nnodes)
        if self.cpu and self.gpus:
            raise ValueError("invalid --cpu: --cpu and --gpus exclude each other; pick one")
        if self.dataset != "synthetic" and self.data_dir is None:
            raise ValueError(f"invalid --data-dir: --dataset {self.dataset} needs --data-dir DIR")
        if self.strategy == "balanced-dp" and self.gpu0_batch is None:
            raise ValueError("invalid --gpu0-batch: --strategy balanced-dp needs --gpu0-batch N")
        return self

    # Values derived from the config, never stored twice.
    @property
    def uses_gpus(self) -> bool:
        return not self.cpu and bool(self.gpus)

    @property
    def nproc_per_node(self) -> int:
        if self.strategy != "ddp":
            return 1
        return len(self.gpus) if self.gpus and not self.cpu else (self.nproc or 2)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def global_batch(self) -> int:
        return self.per_gpu_batch * self.world_size * self.accumulate

    # Settings `ddpcli.resolve` fills in before any worker starts: None only until then.
    @property
    def resolved_out(self) -> Path:
        return _resolved(self.out, "out")

    @property
    def resolved_arch(self) -> str:
        return _resolved(self.arch, "arch")

    @property
    def resolved_image_size(self) -> int:
        return _resolved(self.image_size, "image_size")

    @property
    def resolved_data_dir(self) -> Path:
        """--data-dir, which every data set but the synthetic one requires (`_consistent`)."""
        if self.data_dir is None:
            raise RuntimeError(f"TrainConfig.data_dir read, but --dataset {self.dataset} has none")
        return self.data_dir


Value = TypeVar("Value")


def _resolved(value: Value | None, name: str) -> Value:
    if value is None:
        raise RuntimeError(f"TrainConfig.{name} read before ddpcli.resolve filled it in")
    return value


def load_recipe(path: Path) -> dict[str, Any]:
    """A recipe is a TOML file of flag names (`per_gpu_batch = 32` or `per-gpu-batch = 32`),
    at the top level or under a `[train]` table."""
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise usage_error(f"recipe {path} does not exist; see recipes/ for examples") from None
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise usage_error(f"recipe {path} is not readable TOML: {error}") from None
    table = data.get("train", data)
    if not isinstance(table, dict):
        raise usage_error(f"recipe {path}: [train] must be a table of settings")
    return {key.replace("-", "_"): value for key, value in table.items()}


def build_train_config(
    flags: dict[str, Any], recipe: Path | None, environ: Mapping[str, str] | None = None
) -> TrainConfig:
    """Defaults < recipe < flags; flags left at None mean "not given"."""
    values = load_recipe(recipe) if recipe else {}
    values.update(given(flags))
    env = os.environ if environ is None else environ
    if env.get(TRACE_SAMPLES_VARIABLE):
        values.setdefault("trace_samples", Path(env[TRACE_SAMPLES_VARIABLE]))
    return validated(TrainConfig, values)
