"""What `ddpcli train --dataset shards` checks before any step, without torch (the launcher
asks before any worker starts, each rank again when it reads the index): both splits hold
samples, and every shard the index names is there with the bytes it says (a local folder:
a size is one stat; a URL's shards are checked as they are read); and that a checkpoint
saved inside an epoch resumes over the shards it was saved with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddpcli.data.shards.index import SPLITS, ShardIndex, read_index, split_stamp
from ddpcli.data.shards.storage import ShardStore, is_url, shard_store
from ddpcli.errors import USAGE, agreed_error, usage_error


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


def check_resumed_shards(
    position: dict[str, Any] | None, location: str | Path, checkpoint: str | Path
) -> None:
    """For the launcher: CHECKPOINT's stream position against the index at LOCATION."""
    if position and position.get("index"):
        train = read_index(location).splits["train"]
        check_resumed_index(position, split_stamp(train), shard_store(location), checkpoint)


def check_resumed_index(
    position: dict[str, Any] | None,
    now: dict[str, Any],
    store: ShardStore,
    checkpoint: str | Path,
) -> None:
    """A stream position counts the samples of the train shards it was saved with: over
    other shards (packed again, with another --seed or --shard-size, or other images) the
    rest of its epoch would train some samples twice and others never. Refused (exit 2),
    saying what changed, against NOW (the train split's `split_stamp`). A position without
    the stamp (an older ddpcli's) is not checked."""
    saved = (position or {}).get("index")
    if not position or not saved or saved.get("sha256") == now["sha256"]:
        return
    epoch = int(position["plan"]["epoch"]) + 1
    then, today = (
        f"{stamp['shards']} shards of {stamp['samples']} samples" for stamp in (saved, now)
    )
    change = f"{then} then, {today} now" if then != today else f"{then}, other contents"
    # Every rank reads the same index and says the same: said once for all of them.
    raise agreed_error(
        f"cannot resume from {checkpoint} inside epoch {epoch}: the train shards at "
        f"{store.shown} are not those it was saved with ({change}), and its stream position "
        "counts their samples (some would be trained twice, others never); put those shards "
        "back, or start a new run from its weights with --init-from PATH",
        USAGE,
    )
