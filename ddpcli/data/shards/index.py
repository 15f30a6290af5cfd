"""The index of a packed folder (`index.json`): what `ddpcli data verify` checks the shards
against and what a reader plans an epoch from, without opening a shard.

```
{"format": "ddpcli-shards/1", "source": "imagefolder" | "stl10", "seed": 0,
 "shard_size": 268435456,
 "splits": {"train": {"classes": [...], "samples": N, "bytes": B,
                      "shards": [{"name": "train-000000.tar", "samples": n, "bytes": b,
                                  "sha256": "..."}, ...]},
            "val": {...}}}
```
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddpcli.data.shards.storage import is_url, shard_store
from ddpcli.errors import usage_error
from ddpcli.files import fsync_dir, write_text_atomic

FORMAT = "ddpcli-shards/1"
INDEX_NAME = "index.json"
SPLITS = ("train", "val")


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:06d}.tar"


@dataclass(frozen=True)
class ShardRecord:
    name: str
    samples: int
    bytes: int
    sha256: str


@dataclass
class SplitIndex:
    classes: list[str]
    shards: list[ShardRecord] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(shard.samples for shard in self.shards)

    @property
    def bytes(self) -> int:
        return sum(shard.bytes for shard in self.shards)


@dataclass
class ShardIndex:
    source: str
    seed: int
    shard_size: int
    splits: dict[str, SplitIndex]

    def shards(self) -> list[tuple[str, ShardRecord]]:
        """Every shard with its split, in the index's order."""
        return [(name, shard) for name, split in self.splits.items() for shard in split.shards]


def split_stamp(split: SplitIndex) -> dict[str, Any]:
    """What tells one pack of a split from another: its shards and samples, and a SHA-256
    over each shard's name, sample count and SHA-256 (the same shards in the same order
    give the same, whatever packed them)."""
    records = [[shard.name, shard.samples, shard.sha256] for shard in split.shards]
    digest = hashlib.sha256(json.dumps(records).encode()).hexdigest()
    return {"shards": len(split.shards), "samples": split.samples, "sha256": digest}


def index_document(index: ShardIndex) -> dict[str, Any]:
    splits = {
        name: {
            "classes": split.classes,
            "samples": split.samples,
            "bytes": split.bytes,
            "shards": [asdict(shard) for shard in split.shards],
        }
        for name, split in index.splits.items()
    }
    return {
        "format": FORMAT,
        "source": index.source,
        "seed": index.seed,
        "shard_size": index.shard_size,
        "splits": splits,
    }


def write_index(out: Path, index: ShardIndex) -> Path:
    """Written last, atomically: an index names only shards that are whole on disk."""
    path = out / INDEX_NAME
    write_text_atomic(path, json.dumps(index_document(index), indent=1) + "\n")
    fsync_dir(out)
    return path


def read_index(out: str | Path) -> ShardIndex:
    """The index of OUT (a folder or a URL), or exit 2 saying why there is none to read."""
    store = shard_store(out)
    path = store.url(INDEX_NAME)
    if not store.exists(INDEX_NAME):
        store.check_container()
        raise usage_error(
            f"{path} is missing: {store.shown} holds no packed shards; pack them with "
            "`ddpcli data pack SRC OUT`" + (" and upload OUT there" if is_url(out) else "")
        )
    try:
        document = json.loads(store.read_text(INDEX_NAME))
        return index_from_document(document)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise usage_error(
            f"{path} is not a ddpcli shard index ({error}); pack the data again with "
            "`ddpcli data pack SRC OUT --force`"
        ) from None


def index_from_document(document: Any) -> ShardIndex:
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, dict) else None
        raise ValueError(f"format {found!r}, expected {FORMAT!r}")
    splits = {
        name: SplitIndex(
            classes=[str(label) for label in split["classes"]],
            shards=[shard_record(shard) for shard in split["shards"]],
        )
        for name, split in document["splits"].items()
    }
    return ShardIndex(
        source=str(document["source"]),
        seed=int(document["seed"]),
        shard_size=int(document["shard_size"]),
        splits=splits,
    )


def shard_record(entry: dict[str, Any]) -> ShardRecord:
    name = str(entry["name"])
    if "/" in name or name.startswith("."):
        raise ValueError(f"shard name {name!r} is not a file in the folder")
    return ShardRecord(name, int(entry["samples"]), int(entry["bytes"]), str(entry["sha256"]))
