"""`ddpcli data pack|verify`'s configuration: where the samples come from, where the shards
go, how big each is and how many processes write or check them; and where shards are read
from (a folder or a URL), which `ddpcli train --data-dir` shares."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, PlainValidator, SerializationInfo, WrapSerializer

from ddpcli.config.barrier import parse_size_list
from ddpcli.config.common import CommandConfig, given, validated
from ddpcli.errors import usage_error
from ddpcli.machine import cpu_count

DEFAULT_SHARD_SIZE = "256MB"
MIN_SHARD_BYTES = 1 << 10
MAX_SHARD_BYTES = 1 << 40
# Packing reads files and writes tars: past a few processes a disk, not the CPU, is the limit.
MAX_DEFAULT_WORKERS = 8
# DDPCLI_SLOW_PACK=SECONDS: each sample, once written into its shard's temporary file, waits
# SECONDS. A pack slow on purpose, that a test can interrupt mid-shard on a busy machine.
SLOW_PACK_VARIABLE = "DDPCLI_SLOW_PACK"
# `train --dataset shards`' default shuffle buffer: this fraction of the node's available
# memory, shared by its streams (ranks x workers), in samples of the index's mean size,
# within these bounds (ddpcli.data.shards.feed sizes it; --help states it).
BUFFER_MEMORY_FRACTION = 1 / 8
BUFFER_BOUNDS = (64, 10_000)


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


# What fsspec reads shards from (ddpcli.data.shards.storage). file:// and memory:// are
# fsspec's own, handy in tests and for a path that must not be taken for a folder's.
URL_SCHEMES = ("s3://", "gs://", "gcs://", "http://", "https://", "file://", "memory://")
# user:password@ in a URL's authority: said as ***@, never shown or saved.
URL_CREDENTIALS = re.compile(r"\b([a-z][a-z0-9+.-]*://)[^/@\s]*@", re.IGNORECASE)
# The serialization context that keeps a URL's credentials: only for the launcher's private
# request to its own workers.
WITH_CREDENTIALS = "with_credentials"


def is_url(location: object) -> bool:
    return isinstance(location, str) and location.lower().startswith(URL_SCHEMES)


def redacted_url(text: str) -> str:
    """TEXT with a URL's user:password@ replaced, so that messages and files never hold it."""
    return URL_CREDENTIALS.sub(r"\1***@", text)


def location_from_text(value: Any) -> Path | str:
    """A URL stays text (a Path would make s3://bucket into s3:/bucket); the rest is a
    folder."""
    if isinstance(value, Path) or is_url(value):
        return value
    if not isinstance(value, str):
        raise ValueError("give a folder or a URL")
    if "://" in value:
        scheme = value.split("://", 1)[0]
        raise ValueError(
            f"{scheme}:// is not a storage ddpcli reads; give a folder or a URL that starts "
            f"with {', '.join(URL_SCHEMES[:5])}"
        )
    return Path(value)


def location_without_credentials(value: Any, handler: Any, info: SerializationInfo) -> Any:
    if isinstance(value, str) and WITH_CREDENTIALS not in (info.context or ()):
        return redacted_url(value)
    return handler(value)


# A folder or a URL of shards. In config.json and checkpoints a URL's credentials read ***.
DataLocation = Annotated[
    Path | str,
    PlainValidator(location_from_text),
    WrapSerializer(location_without_credentials, when_used="json"),
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
    # debugging: seconds each sample waits in its shard, from DDPCLI_SLOW_PACK
    slow_pack: float = 0.0

    @property
    def processes(self) -> int:
        return self.workers or default_workers()


class DataVerifyConfig(CommandConfig):
    """Everything `ddpcli data verify` needs."""

    out: DataLocation
    workers: int | None = Field(None, ge=1, le=1024)

    @property
    def processes(self) -> int:
        return self.workers or default_workers()


def build_pack_config(
    flags: dict[str, Any], environ: Mapping[str, str] | None = None
) -> DataPackConfig:
    """Flags left at None mean "not given"."""
    env = os.environ if environ is None else environ
    values = given(flags)
    if env.get(SLOW_PACK_VARIABLE):
        values["slow_pack"] = parse_slow_pack(env[SLOW_PACK_VARIABLE])
    return validated(DataPackConfig, values)


def parse_slow_pack(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 60:
        raise usage_error(f"invalid {SLOW_PACK_VARIABLE}: give SECONDS, e.g. 0.5 (got {text!r})")
    return seconds


def build_verify_config(flags: dict[str, Any]) -> DataVerifyConfig:
    return validated(DataVerifyConfig, given(flags))
