"""`ddpcli data pack|verify`'s configuration: where the samples come from, where the shards
go, how big each is and how many processes write or check them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

from ddpcli.config.barrier import parse_size_list
from ddpcli.config.common import CommandConfig, given, validated
from ddpcli.machine import cpu_count

DEFAULT_SHARD_SIZE = "256MB"
MIN_SHARD_BYTES = 1 << 10
MAX_SHARD_BYTES = 1 << 40
# Packing reads files and writes tars: past a few processes a disk, not the CPU, is the limit.
MAX_DEFAULT_WORKERS = 8


def parse_size(text: str) -> int:
    """One byte count as --sizes writes them: 256MB, 1G, 4096 (K, M, G are powers of 1024)."""
    try:
        sizes = parse_size_list(text, "shard-size") if "," not in text else []
    except ValueError:
        sizes = []
    if len(sizes) != 1:
        raise ValueError("give one size in bytes, e.g. 256MB or 1G (K, M, G: powers of 1024)")
    return sizes[0]


def size_from_text(value: Any) -> Any:
    return parse_size(value) if isinstance(value, str) else value


ShardBytes = Annotated[
    int, BeforeValidator(size_from_text), Field(ge=MIN_SHARD_BYTES, le=MAX_SHARD_BYTES)
]


def default_workers() -> int:
    return max(1, min(cpu_count(), MAX_DEFAULT_WORKERS))


class DataPackConfig(CommandConfig):
    """Everything `ddpcli data pack` needs. Field names are the flags with `_` for `-`."""

    src: Path
    out: Path
    shard_size: ShardBytes = Field(
        default_factory=lambda: parse_size(DEFAULT_SHARD_SIZE),
        description="bytes per shard, about: 256MB, 1G (a larger sample gets a shard alone)",
    )
    workers: int | None = Field(None, ge=1, le=1024)
    seed: int = Field(0, ge=0, description="seed of the order samples are spread over shards")
    force: bool = False

    @property
    def processes(self) -> int:
        return self.workers or default_workers()


class DataVerifyConfig(CommandConfig):
    """Everything `ddpcli data verify` needs."""

    out: Path
    workers: int | None = Field(None, ge=1, le=1024)

    @property
    def processes(self) -> int:
        return self.workers or default_workers()


def build_pack_config(flags: dict[str, Any]) -> DataPackConfig:
    """Flags left at None mean "not given"."""
    return validated(DataPackConfig, given(flags))


def build_verify_config(flags: dict[str, Any]) -> DataVerifyConfig:
    return validated(DataVerifyConfig, given(flags))
