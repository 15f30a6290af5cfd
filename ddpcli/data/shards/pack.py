"""`ddpcli data pack`: SRC's samples into tar shards of about --shard-size, written by
--workers processes, then the index, last. Nothing of torch: packing needs files, not a
model."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpcli.config.data import DataPackConfig
from ddpcli.data.shards.index import (
    INDEX_NAME,
    ShardIndex,
    ShardRecord,
    SplitIndex,
    shard_name,
    write_index,
)
from ddpcli.data.shards.parallel import run_parallel
from ddpcli.data.shards.sources import Source, find_source, plan_shards, seeded_order
from ddpcli.data.shards.writer import TEMPORARY_SUFFIX, ShardTask, write_shard
from ddpcli.errors import runtime_error, usage_error
from ddpcli.files import folder_write_problem, fsync_dir

SHARD_FILE = re.compile(r"[a-z]+-\d{6}\.tar")

# Told the number of shards to write, then each shard's record as it is written.
OnPlan = Callable[[int], None]
OnShard = Callable[[ShardRecord], None]


def check_out(cfg: DataPackConfig) -> None:
    """OUT can take the shards, and holds none that a pack would replace unasked."""
    problem = folder_write_problem(cfg.out)
    if problem:
        raise usage_error(f"invalid OUT: cannot write shards into {cfg.out}: {problem}")
    if (cfg.out / INDEX_NAME).exists() and not cfg.force:
        raise usage_error(
            f"invalid OUT: {cfg.out} already holds packed shards ({INDEX_NAME}); pass --force "
            "to replace them, or choose another folder"
        )


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


def clear_the_way(out: Path) -> None:
    """Before the first shard: no index that could name a shard being replaced (a reader
    meanwhile finds no index rather than a wrong one), and no temporary file a pack that
    died left behind."""
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX_NAME).unlink(missing_ok=True)
    for leftover in out.glob(f".*.tar.*{TEMPORARY_SUFFIX}"):
        leftover.unlink(missing_ok=True)
    fsync_dir(out)


def remove_stale_shards(out: Path, index: ShardIndex) -> list[str]:
    """Shards of an earlier pack (--force) that the new index does not name."""
    named = {shard.name for _, shard in index.shards()}
    stale = sorted(
        path.name
        for path in out.glob("*.tar")
        if SHARD_FILE.fullmatch(path.name) and path.name not in named
    )
    for name in stale:
        (out / name).unlink()
    return stale


def pack(
    cfg: DataPackConfig,
    on_plan: OnPlan = lambda shards: None,
    on_shard: OnShard = lambda record: None,
) -> dict[str, Any]:
    """Pack SRC into OUT; the summary of what was written."""
    started = time.monotonic()
    check_out(cfg)
    source = find_source(cfg.src)
    tasks = shard_tasks(source, cfg)
    everything = [task for split_tasks in tasks.values() for task in split_tasks]
    on_plan(len(everything))
    clear_the_way(cfg.out)
    try:
        records = run_parallel(write_shard, everything, cfg.processes, on_shard)
    except OSError as error:
        raise runtime_error(f"packing into {cfg.out} failed: {error}") from None
    fsync_dir(cfg.out)
    index = index_of(source, cfg, tasks, records)
    index_path = write_index(cfg.out, index)
    removed = remove_stale_shards(cfg.out, index)
    return summary(cfg, index, index_path, removed, time.monotonic() - started)


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
