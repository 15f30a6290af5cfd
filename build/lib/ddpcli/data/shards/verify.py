"""`ddpcli data verify`: every shard the index names, checked against it: there, whole, the
same bytes (SHA-256), and holding the samples it says."""

from __future__ import annotations

import hashlib
import tarfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO

from ddpcli.config.data import DataVerifyConfig
from ddpcli.data.shards.index import ShardRecord, read_index
from ddpcli.data.shards.parallel import run_parallel
from ddpcli.data.shards.storage import ShardStore, shard_store
from ddpcli.files import HASH_CHUNK


@dataclass(frozen=True)
class ShardCheck:
    split: str
    name: str
    status: str  # ok, missing, truncated, changed, unreadable
    detail: str


@dataclass(frozen=True)
class VerifyTask:
    store: ShardStore
    split: str
    record: ShardRecord


class HashingReader:
    """A stream that hashes and counts what is read through it, so that one pass front to
    back gives a shard's samples, bytes and SHA-256 (a URL's shard is read once)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.sha256.update(data)
        self.bytes += len(data)
        return data

    def drain(self) -> None:
        """The rest, past the tar's end (its zero blocks), hashed too."""
        while self.read(HASH_CHUNK):
            pass


def sample_count(stream: BinaryIO | HashingReader) -> int:
    """The samples a tar holds, as webdataset groups them: members that share a key. Read in
    stream mode, front to back."""
    with tarfile.open(fileobj=stream, mode="r|") as tar:  # type: ignore[call-overload]
        return len({member.name.partition(".")[0] for member in tar if member.isfile()})


def check_shard(task: VerifyTask) -> ShardCheck:
    store, record = task.store, task.record

    def found(status: str, detail: str) -> ShardCheck:
        return ShardCheck(task.split, record.name, status, detail)

    size = store.size(record.name)
    if size is None:
        return found("missing", "no such file")
    if size < record.bytes:
        return found("truncated", f"{size:,} of {record.bytes:,} bytes")
    if size != record.bytes:
        return found("changed", f"{size:,} bytes, the index says {record.bytes:,}")
    with store.open(record.name) as stream:
        reader = HashingReader(stream)
        try:
            samples: int | None = sample_count(reader)
            tar_error = ""
        except (OSError, tarfile.TarError) as error:
            samples, tar_error = None, str(error)
        reader.drain()
    if reader.sha256.hexdigest() != record.sha256:
        return found("changed", "its SHA-256 is not the index's: the bytes changed")
    if samples is None:
        return found("unreadable", f"not a tar file ({tar_error})")
    if samples != record.samples:
        return found("changed", f"{samples} samples, the index says {record.samples}")
    return found("ok", f"{samples} samples, {size:,} bytes")


def verify(
    cfg: DataVerifyConfig,
    on_plan: Callable[[int], None] = lambda shards: None,
    on_check: Callable[[ShardCheck], None] = lambda check: None,
) -> dict[str, Any]:
    """Every shard's check, and which are bad; exit 2 if OUT holds no readable index.
    ON_PLAN is told the number of shards, ON_CHECK each shard's check as it ends."""
    index = read_index(cfg.out)
    store = shard_store(cfg.out)
    tasks = [VerifyTask(store, split, record) for split, record in index.shards()]
    on_plan(len(tasks))
    checks = run_parallel(check_shard, tasks, cfg.processes, on_check)
    bad = [check.name for check in checks if check.status != "ok"]
    return {
        "out": store.shown,
        "ok": not bad,
        "splits": {
            name: {"shards": len(split.shards), "samples": split.samples, "bytes": split.bytes}
            for name, split in index.splits.items()
        },
        "shards": [asdict(check) for check in checks],
        "bad": bad,
    }
