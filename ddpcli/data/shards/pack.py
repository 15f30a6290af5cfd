"""`ddpcli data pack`: SRC's samples into tar shards of about --shard-size, written by
--workers processes, then the index, last. Nothing of torch: packing needs files, not a
model."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpcli.config.data import DataPackConfig
from ddpcli.data.layout import listed
from ddpcli.data.shards.index import (
    INDEX_NAME,
    SPLITS,
    ShardIndex,
    ShardRecord,
    SplitIndex,
    read_index,
    shard_name,
    write_index,
)
from ddpcli.data.shards.parallel import run_parallel
from ddpcli.data.shards.sources import (
    Source,
    find_source,
    plan_shards,
    seeded_order,
    source_folder,
    unreadable_source,
)
from ddpcli.data.shards.writer import TEMPORARY_SUFFIX, ShardTask, write_shard
from ddpcli.errors import DdpcliError, runtime_error, usage_error
from ddpcli.files import folder_write_problem, fsync_dir, write_text_atomic

# The names a pack writes: anything so named in OUT is a pack's to replace only if a pack
# of ddpcli wrote it (webdataset's own tools name their shards the same way).
SHARD_FILE = re.compile(rf"({'|'.join(SPLITS)})-\d{{6}}\.tar")
# Hidden, beside the shards while a pack is under way: the shards it may write or replace.
# A pack that was stopped leaves it, with no index; the next one knows those shards as a
# pack's, not someone else's.
PENDING_NAME = ".ddpcli-pack-pending.json"

# Told the number of shards to write, then each shard's record as it is written.
OnPlan = Callable[[int], None]
OnShard = Callable[[ShardRecord], None]


def check_out(cfg: DataPackConfig) -> set[str]:
    """OUT can take the shards, is not SRC nor inside it, and holds none that a pack would
    replace unasked: the shards an earlier pack wrote there (its index's, or those of a
    pack that was stopped), which this pack may replace."""
    check_apart(cfg.src, cfg.out)
    problem = folder_write_problem(cfg.out)
    if problem:
        raise usage_error(f"invalid OUT: cannot write shards into {cfg.out}: {problem}")
    if (cfg.out / INDEX_NAME).exists() and not cfg.force:
        raise usage_error(
            f"invalid OUT: {cfg.out} already holds packed shards ({INDEX_NAME}); pass --force "
            "to replace them, or choose another folder"
        )
    earlier = earlier_shards(cfg.out)
    strangers = sorted(set(shard_files(cfg.out)) - earlier)
    if strangers:
        raise usage_error(
            f"invalid OUT: {cfg.out} holds {listed(strangers)}, named as shards but not "
            f"written by a pack there ({INDEX_NAME} names none of them): a pack would "
            "overwrite or delete them; move them out of OUT, or choose another folder"
        )
    return earlier


def check_apart(src: Path, out: Path) -> None:
    """OUT = SRC would leave an index among the images (a later `train --data-dir SRC` reads
    the shards, not the images), and OUT inside the folder of images would pack the shards'
    folder as a class the next time."""
    images, target = source_folder(src).resolve(), out.resolve()
    if target == src.resolve() or target == images or images in target.parents:
        raise usage_error(
            f"invalid OUT: {out} is {'SRC' if target == src.resolve() else 'inside SRC'} "
            f"({src}); write the shards to a folder outside it"
        )


def shard_files(out: Path) -> list[str]:
    if not out.is_dir():
        return []
    return [path.name for path in out.iterdir() if SHARD_FILE.fullmatch(path.name)]


def earlier_shards(out: Path) -> set[str]:
    """The shards that packs wrote in OUT: those its index names, and those a pack that was
    stopped listed before it began. An unreadable index names none; a name no pack writes
    is never taken from either (a pack deletes what they name)."""
    named: set[str] = set()
    if (out / INDEX_NAME).is_file():
        with contextlib.suppress(DdpcliError):
            named.update(shard.name for _, shard in read_index(out).shards())
    with contextlib.suppress(OSError, ValueError, TypeError):
        named.update(str(name) for name in json.loads((out / PENDING_NAME).read_text()))
    return {name for name in named if SHARD_FILE.fullmatch(name)}


def shard_tasks(source: Source, cfg: DataPackConfig) -> dict[str, list[ShardTask]]:
    return {
        split: [
            ShardTask(str(cfg.out), shard_name(split, number), items, cfg.slow_pack)
            for number, items in enumerate(
                plan_shards(seeded_order(samples.items, cfg.seed), cfg.shard_size)
            )
        ]
        for split, samples in source.splits.items()
    }


def clear_the_way(out: Path, touched: set[str]) -> None:
    """Before the first shard: the shards this pack may write or replace listed (TOUCHED),
    no index that could name a shard being replaced (a reader meanwhile finds no index
    rather than a wrong one), and no temporary file a pack that died left behind."""
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / PENDING_NAME, json.dumps(sorted(touched)) + "\n")
    (out / INDEX_NAME).unlink(missing_ok=True)
    remove_temporaries(out)


def remove_temporaries(out: Path) -> None:
    """The half-written shards of workers that were stopped (Ctrl-C, an error) or died."""
    for leftover in out.glob(f".*.tar.*{TEMPORARY_SUFFIX}"):
        leftover.unlink(missing_ok=True)
    fsync_dir(out)


def remove_stale_shards(out: Path, earlier: set[str], index: ShardIndex) -> list[str]:
    """Shards of an earlier pack (EARLIER) that the new index does not name; no other file."""
    named = {shard.name for _, shard in index.shards()}
    stale = sorted(name for name in earlier - named if (out / name).is_file())
    for name in stale:
        (out / name).unlink()
    (out / PENDING_NAME).unlink(missing_ok=True)
    fsync_dir(out)
    return stale


def pack(
    cfg: DataPackConfig,
    on_plan: OnPlan = lambda shards: None,
    on_shard: OnShard = lambda record: None,
) -> dict[str, Any]:
    """Pack SRC into OUT; the summary of what was written."""
    started = time.monotonic()
    earlier = check_out(cfg)
    source = find_source(cfg.src)
    tasks = shard_tasks(source, cfg)
    everything = [task for split_tasks in tasks.values() for task in split_tasks]
    on_plan(len(everything))
    clear_the_way(cfg.out, earlier | {task.name for task in everything})
    try:
        records = run_parallel(write_shard, everything, cfg.processes, on_shard)
    except OSError as error:
        raise packing_failed(cfg, error) from None
    finally:
        remove_temporaries(cfg.out)
    fsync_dir(cfg.out)
    index = index_of(source, cfg, tasks, records)
    index_path = write_index(cfg.out, index)
    removed = remove_stale_shards(cfg.out, earlier, index)
    return summary(cfg, index, index_path, removed, time.monotonic() - started)


def packing_failed(cfg: DataPackConfig, error: OSError) -> DdpcliError:
    """A file of SRC that cannot be read is bad input (exit 2, naming it); the rest, such
    as a full disk, a failure at run time."""
    path = Path(error.filename) if error.filename else None
    if path is not None and cfg.src.absolute() in path.absolute().parents:
        return unreadable_source(path, error)
    return runtime_error(f"packing into {cfg.out} failed: {error}")


def index_of(
    source: Source,
    cfg: DataPackConfig,
    tasks: dict[str, list[ShardTask]],
    records: list[ShardRecord],
) -> ShardIndex:
    by_name = {record.name: record for record in records}
    splits = {
        split: SplitIndex(source.splits[split].classes, [by_name[task.name] for task in planned])
        for split, planned in tasks.items()
    }
    return ShardIndex(source.kind, cfg.seed, cfg.shard_size, splits)


def summary(
    cfg: DataPackConfig, index: ShardIndex, index_path: Path, removed: list[str], seconds: float
) -> dict[str, Any]:
    splits = {
        name: {
            "samples": split.samples,
            "shards": len(split.shards),
            "bytes": split.bytes,
            "classes": len(split.classes),
        }
        for name, split in index.splits.items()
    }
    return {
        "out": str(cfg.out),
        "index": str(index_path),
        "source": index.source,
        "shard_size": cfg.shard_size,
        "workers": cfg.processes,
        "splits": splits,
        "removed_stale_shards": removed,
        "seconds": round(seconds, 3),
    }
