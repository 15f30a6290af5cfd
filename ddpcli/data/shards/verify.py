"""`ddpcli data verify`: every shard the index names, checked against it: there, whole, the
same bytes (SHA-256), holding the samples it says, each with a class number the index
names."""

from __future__ import annotations

import hashlib
import tarfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import IO, Any, BinaryIO

from ddpcli.config.data import DataVerifyConfig
from ddpcli.data.shards.index import ShardRecord, read_index
from ddpcli.data.shards.parallel import run_parallel
from ddpcli.data.shards.storage import ShardStore, shard_store
from ddpcli.data.shards.stream import LABEL_SUFFIX
from ddpcli.files import HASH_CHUNK


@dataclass(frozen=True)
class ShardCheck:
    split: str
    name: str
    status: str  # ok, missing, truncated, changed, unreadable, bad-label
    detail: str


@dataclass(frozen=True)
class VerifyTask:
    store: ShardStore
    split: str
    record: ShardRecord
    classes: int  # the split's classes in the index: each class number must be below it


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


@dataclass(frozen=True)
class TarContents:
    samples: int
    bad_label: str  # the first KEY.cls that is no class number of the index, in words; or ""


def read_contents(stream: BinaryIO | HashingReader, classes: int) -> TarContents:
    """The samples a tar holds, as webdataset groups them (members that share a key), and
    whether each KEY.cls is a class number below CLASSES: training would fail on one that is
    not. Read in stream mode, front to back."""
    keys: set[str] = set()
    bad_label = ""
    with tarfile.open(fileobj=stream, mode="r|") as tar:  # type: ignore[call-overload]
        for member in tar:
            if not member.isfile():
                continue
            key, _, suffix = member.name.partition(".")
            keys.add(key)
            if suffix == LABEL_SUFFIX and not bad_label:
                bad_label = label_problem(key, tar.extractfile(member), classes)
    return TarContents(len(keys), bad_label)


def label_problem(key: str, handle: IO[bytes] | None, classes: int) -> str:
    text = handle.read().decode(errors="replace").strip() if handle is not None else ""
    if text.isdigit() and int(text) < classes:
        return ""
    return f"{key}.cls holds {text!r}, and the index names {classes} classes (0 to {classes - 1})"


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
            contents: TarContents | None = read_contents(reader, task.classes)
            tar_error = ""
        except (OSError, tarfile.TarError) as error:
            contents, tar_error = None, str(error)
        reader.drain()
    if reader.sha256.hexdigest() != record.sha256:
        return found("changed", "its SHA-256 is not the index's: the bytes changed")
    if contents is None:
        return found("unreadable", f"not a tar file ({tar_error})")
    if contents.samples != record.samples:
        return found("changed", f"{contents.samples} samples, the index says {record.samples}")
    if contents.bad_label:
        return found("bad-label", contents.bad_label)
    return found("ok", f"{contents.samples} samples, {size:,} bytes")


def verify(
    cfg: DataVerifyConfig,
    on_plan: Callable[[int], None] = lambda shards: None,
    on_check: Callable[[ShardCheck], None] = lambda check: None,
) -> dict[str, Any]:
    """Every shard's check, and which are bad; exit 2 if OUT holds no readable index.
    ON_PLAN is told the number of shards, ON_CHECK each shard's check as it ends."""
    index = read_index(cfg.out)
    store = shard_store(cfg.out)
    tasks = [
        VerifyTask(store, split, record, len(index.splits[split].classes))
        for split, record in index.shards()
    ]
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
