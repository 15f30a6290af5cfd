"""`ddpcli data verify`: every shard the index names, checked against it: there, whole, the
same bytes (SHA-256), and holding the samples it says."""

from __future__ import annotations

import tarfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddpcli.config.data import DataVerifyConfig
from ddpcli.data.shards.index import ShardRecord, read_index
from ddpcli.data.shards.parallel import run_parallel
from ddpcli.files import file_sha256


@dataclass(frozen=True)
class ShardCheck:
    split: str
    name: str
    status: str  # ok, missing, truncated, changed, unreadable
    detail: str


@dataclass(frozen=True)
class VerifyTask:
    out: str
    split: str
    record: ShardRecord


def sample_count(path: Path) -> int:
    """The samples a tar holds, as webdataset groups them: members that share a key."""
    with tarfile.open(path) as tar:
        return len({member.name.partition(".")[0] for member in tar if member.isfile()})


def check_shard(task: VerifyTask) -> ShardCheck:
    path, record = Path(task.out) / task.record.name, task.record

    def found(status: str, detail: str) -> ShardCheck:
        return ShardCheck(task.split, record.name, status, detail)

    if not path.is_file():
        return found("missing", "no such file")
    size = path.stat().st_size
    if size < record.bytes:
        return found("truncated", f"{size:,} of {record.bytes:,} bytes")
    if size != record.bytes:
        return found("changed", f"{size:,} bytes, the index says {record.bytes:,}")
    if file_sha256(path) != record.sha256:
        return found("changed", "its SHA-256 is not the index's: the bytes changed")
    try:
        samples = sample_count(path)
    except (OSError, tarfile.TarError) as error:
        return found("unreadable", f"not a tar file ({error})")
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
    tasks = [VerifyTask(str(cfg.out), split, record) for split, record in index.shards()]
    on_plan(len(tasks))
    checks = run_parallel(check_shard, tasks, cfg.processes, on_check)
    bad = [check.name for check in checks if check.status != "ok"]
    return {
        "out": str(cfg.out),
        "ok": not bad,
        "splits": {
            name: {"shards": len(split.shards), "samples": split.samples, "bytes": split.bytes}
            for name, split in index.splits.items()
        },
        "shards": [asdict(check) for check in checks],
        "bad": bad,
    }
