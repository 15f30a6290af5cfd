"""One shard written: a tar in webdataset's layout (KEY.jpg|png, KEY.cls per sample), with
fixed headers so that the same samples always give the same bytes, and written atomically
(temporary name, fsync, rename) so that no half shard is ever visible under its name."""

from __future__ import annotations

import io
import os
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from ddpcli.data.shards import stl10
from ddpcli.data.shards.index import ShardRecord
from ddpcli.data.shards.sources import PackItem
from ddpcli.files import HashingWriter

# Hidden, and named by the writing process: a reader globbing *.tar never sees one, and a
# pack that died leaves names the next pack recognises and removes.
TEMPORARY_SUFFIX = ".partial"


@dataclass(frozen=True)
class ShardTask:
    out: str
    name: str
    items: list[PackItem]
    slow_pack: float = 0.0  # seconds each sample waits in the temporary file (DDPCLI_SLOW_PACK)


def temporary_path(out: Path, name: str) -> Path:
    return out / f".{name}.{os.getpid()}{TEMPORARY_SUFFIX}"


def member_bytes(item: PackItem) -> bytes:
    """The file's own bytes (no re-encode), or STL-10's pixels as a lossless PNG."""
    if item.stl10_index >= 0:
        return stl10.png_bytes(Path(item.path), item.stl10_index)
    return Path(item.path).read_bytes()


def fixed_header(name: str, size: int) -> tarfile.TarInfo:
    """Nothing of the machine or the moment in a header: owner, group, time and mode fixed."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    tar.addfile(fixed_header(name, len(data)), io.BytesIO(data))


def write_shard(task: ShardTask) -> ShardRecord:
    """Write TASK's shard into its folder; its size and SHA-256 as on disk."""
    out = Path(task.out)
    temporary = temporary_path(out, task.name)
    try:
        with open(temporary, "wb") as handle:
            writer = HashingWriter(handle)
            # PAX: names past 100 characters and any UTF-8 kept whole, readable by any tar.
            # Writing, tarfile needs only write() and tell() of its file object.
            with tarfile.open(
                fileobj=writer,  # type: ignore[call-overload]
                mode="w",
                format=tarfile.PAX_FORMAT,
            ) as tar:
                for item in task.items:
                    add_member(tar, f"{item.key}.{item.suffix}", member_bytes(item))
                    add_member(tar, f"{item.key}.cls", str(item.label).encode())
                    if task.slow_pack:
                        time.sleep(task.slow_pack)
            handle.flush()
            os.fsync(handle.fileno())
        record = ShardRecord(
            task.name, len(task.items), temporary.stat().st_size, writer.sha256.hexdigest()
        )
        os.replace(temporary, out / task.name)
        return record
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
