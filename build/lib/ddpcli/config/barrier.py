"""`ddpcli bench-barrier`'s configuration: the BarrierConfig schema and its flag rules."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from ddpcli.config.common import (
    Backend,
    CommandConfig,
    GpuList,
    from_comma_text,
    given,
    parse_float_list,
    validated,
)

BarrierDemo = Literal["staggered", "zero-first", "none"]
CollectiveName = Literal["all_reduce", "all_gather", "broadcast"]
SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MAX_MESSAGE_BYTES = 16 << 30
DEFAULT_STAGGER_S = 0.25  # staggered demo without --sleeps/--stagger: rank r sleeps 0.25 x r
DEFAULT_WORK_S = 0.3  # zero-first demo without --sleeps/--stagger: every rank works 0.3 s


def parse_size_list(text: str, name: str) -> list[int]:
    """Byte counts the way nccl-tests writes them: 4,1K,1M,64M (K, M, G are powers of 1024)."""
    sizes: list[int] = []
    for part in text.replace(" ", "").upper().split(","):
        if part == "":
            continue
        match = re.fullmatch(r"(\d+)([KMG]?)(?:I?B)?", part)
        if not match:
            raise ValueError(
                f"{name} takes a comma-separated list of byte counts, e.g. 4,1K,1M,64M"
            )
        sizes.append(int(match.group(1)) * SIZE_UNITS[match.group(2)])
    return sizes


def parse_name_list(text: str, name: str) -> list[str]:
    """Collective names as flags spell them: all_reduce,all-gather,broadcast."""
    return [part for part in text.replace(" ", "").replace("-", "_").split(",") if part]


class BarrierConfig(CommandConfig):
    """Everything `ddpcli bench-barrier` needs. Field names are the flags with `_` for `-`.

    Fields that depend on the number of ranks come after `nproc` and `gpus`, so their
    validators can check against it and name the flag that is wrong.
    """

    nproc: int | None = Field(None, ge=1, le=1024)
    gpus: GpuList = None
    backend: Backend = "auto"
    demo: BarrierDemo = "staggered"
    sleeps: Annotated[list[float] | None, from_comma_text(parse_float_list, "sleeps")] = None
    stagger: float | None = Field(None, ge=0, le=3600)
    iters: int = Field(200, ge=1, le=10_000_000)
    warmup: int = Field(10, ge=0, le=1_000_000)
    collective: Annotated[list[CollectiveName], from_comma_text(parse_name_list, "collective")] = (
        Field(default_factory=list)
    )
    sizes: Annotated[list[int], from_comma_text(parse_size_list, "sizes")] = Field(
        default_factory=lambda: parse_size_list("4,1K,1M,64M", "sizes")
    )
    skip_rank: int | None = Field(None, ge=0)
    timeout: float = Field(30.0, gt=0, le=86400, description="seconds a rank waits at a barrier")

    @field_validator("gpus")
    @classmethod
    def _gpus_or_nproc(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if value is not None and info.data.get("nproc") is not None:
            raise ValueError("--gpus runs one process per listed GPU; drop --nproc")
        return value

    @field_validator("backend")
    @classmethod
    def _nccl_needs_gpus(cls, value: str, info: ValidationInfo) -> str:
        if value == "nccl" and not info.data.get("gpus"):
            raise ValueError("nccl runs on GPUs: list them with --gpus 0,1")
        return value

    @field_validator("sleeps")
    @classmethod
    def _one_sleep_per_rank(
        cls, value: list[float] | None, info: ValidationInfo
    ) -> list[float] | None:
        if value is None:
            return value
        if any(not 0 <= seconds <= 3600 for seconds in value):
            raise ValueError("sleeps are seconds, each between 0 and 3600")
        world_size = _world_size_so_far(info)
        if world_size is not None and len(value) != world_size:
            raise ValueError(
                f"give one value per rank: {len(value)} value(s) for {world_size} ranks "
                "(set the ranks with --nproc or --gpus)"
            )
        return value

    @field_validator("stagger")
    @classmethod
    def _stagger_or_sleeps(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and info.data.get("sleeps") is not None:
            raise ValueError("--stagger and --sleeps exclude each other; pick one")
        return value

    @field_validator("sizes")
    @classmethod
    def _sizes_in_range(cls, value: list[int]) -> list[int]:
        if not value:
            raise ValueError("give at least one message size, e.g. 4,1K,1M,64M")
        if any(not 1 <= size <= MAX_MESSAGE_BYTES for size in value):
            raise ValueError("message sizes are 1 byte to 16G")
        return value

    @field_validator("skip_rank")
    @classmethod
    def _skip_rank_exists(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None:
            return value
        world_size = _world_size_so_far(info)
        if world_size is not None and world_size < 2:
            raise ValueError("a rank can only be missed by others: use 2 or more ranks")
        if world_size is not None and value >= world_size:
            raise ValueError(f"rank {value} does not exist: ranks are 0..{world_size - 1}")
        if info.data.get("demo", "staggered") != "staggered":
            raise ValueError("the skipped barrier is the staggered demo's: drop --demo")
        return value

    @property
    def world_size(self) -> int:
        return len(self.gpus) if self.gpus else (self.nproc or 2)

    @property
    def uses_gpus(self) -> bool:
        return bool(self.gpus)

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.uses_gpus else "gloo"

    @property
    def sleeps_per_rank(self) -> list[float]:
        """What each rank sleeps (staggered demo) or works (zero-first demo), in seconds."""
        if self.sleeps is not None:
            return list(self.sleeps)
        if self.stagger is None and self.demo == "zero-first":
            return [DEFAULT_WORK_S] * self.world_size
        stagger = DEFAULT_STAGGER_S if self.stagger is None else self.stagger
        return [stagger * rank for rank in range(self.world_size)]


def _world_size_so_far(info: ValidationInfo) -> int | None:
    """The rank count from fields validated before this one; None if they were invalid."""
    if "nproc" not in info.data or "gpus" not in info.data:
        return None
    gpus = info.data["gpus"]
    return len(gpus) if gpus else (info.data["nproc"] or 2)


def build_barrier_config(flags: dict[str, Any]) -> BarrierConfig:
    """Flags left at None mean "not given"."""
    return validated(BarrierConfig, given(flags))
