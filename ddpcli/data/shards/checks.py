"""What `ddpcli train --dataset shards` checks before any step, without torch (the launcher
asks before any worker starts, each rank again when it reads the index): both splits hold
samples, and every shard the index names is there with the bytes it says (a local folder:
a size is one stat; a URL's shards are checked as they are read)."""

from __future__ import annotations

from pathlib import Path

from ddpcli.data.shards.index import SPLITS, ShardIndex, read_index
from ddpcli.data.shards.storage import ShardStore, is_url, shard_store
from ddpcli.errors import usage_error


def check_shard_source(location: str | Path) -> ShardIndex:
    """LOCATION's index, checked against its shards: exit 2 naming what is wrong."""
    index = read_index(location)
    check_shard_index(index, shard_store(location))
    return index


def check_shard_index(index: ShardIndex, store: ShardStore) -> None:
    for split in SPLITS:
        found = index.splits.get(split)
        if found is None or not found.samples:
            raise usage_error(
                f"{store.url('index.json')}: its {split} split is empty; training needs samples "
                f"in train and val: pack a folder with both (`ddpcli data pack SRC OUT`)"
            )
    if is_url(store.location):
        return
    for split in SPLITS:
        for record in index.splits[split].shards:
            size = store.size(record.name)
            if size == record.bytes:
                continue
            found_words = "is missing" if size is None else f"holds {size:,} bytes"
            raise usage_error(
                f"shard {store.url(record.name)} {found_words}, index.json says {record.bytes:,}: "
                f"the index does not match its shards (a copy cut short?); check them with "
                f"`ddpcli data verify {store.shown}` and pack again"
            )
