"""A shard's samples as raw bytes, read front to back through the store (a tar in stream
mode never seeks), and a stream's outputs: its shards' samples through its seeded shuffle
buffer (ddpcli.data.shards.plan). Nothing here decodes an image.

A shard that is cut short, unreadable as a tar, or holds other samples than the index says
stops the run with BadShard (exit 2), naming it: the index and its shards disagree.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Collection, Container, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import BinaryIO

from ddpcli.data.shards.plan import (
    EpochPlan,
    Piece,
    ShardTable,
    shuffled,
    stream_generator,
    stream_spans,
)
from ddpcli.data.shards.storage import ShardStore
from ddpcli.errors import USAGE, DdpcliError, first_line

LABEL_SUFFIX = "cls"


class BadShard(DdpcliError):
    """A shard that does not hold what the index says: exit 2, naming it.

    Raised in a DataLoader worker, it reaches the training process re-created from the
    worker's formatted traceback, whose last line is `...BadShard: <message>`; only that
    message is kept, so the user still reads one line."""

    def __init__(self, message: str) -> None:
        last = (message.strip().splitlines() or [message])[-1]
        super().__init__(last.split(f"{BadShard.__name__}: ", 1)[-1], USAGE)


def damaged(store: ShardStore, name: str, what: str) -> BadShard:
    location = store.shown
    return BadShard(
        f"shard {store.url(name)} {what}: it does not match {location}/index.json; check the "
        f"shards with `ddpcli data verify {location}` and pack them again"
    )


@dataclass(frozen=True)
class RawSample:
    """A sample as packed: its number (the shard's first number + its position), `shard:key`
    as messages name it, the image's bytes and its label."""

    number: int
    name: str
    image: bytes
    label: int


def member_key(name: str) -> tuple[str, str]:
    """(key, suffix) as webdataset splits a member's name: at the first dot of its base."""
    folder, _, base = name.rpartition("/")
    stem, _, suffix = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), suffix


def shard_samples(
    store: ShardStore, table: ShardTable, shard: int, first: int, end: int
) -> Iterator[RawSample]:
    """Good samples FIRST..END-1 of SHARD (counting only those read: --skip-bad-images' are
    passed over); the shard is read to its end when END is its last, to check its count."""
    name, count = table.names[shard], table.counts[shard]
    wanted = good_positions(count, table.left_out.get(shard, []), first, end)
    stop = max(wanted, default=-1) + 1
    reads_to_end = end == table.good(shard)
    try:
        with store.open(name) as stream, tar_stream(stream) as tar:
            found = 0
            for position, key, members in grouped(tar, wanted):
                found = position + 1
                if position in wanted:
                    yield raw_sample(store, table, shard, position, key, members)
                elif position >= stop and not reads_to_end:
                    return
            if found != count:
                said = f"holds {found} samples, the index says {count}"
                raise damaged(store, name, said + (" (cut short?)" if found < count else ""))
    except (tarfile.TarError, EOFError, OSError) as error:
        raise damaged(store, name, f"is cut short or not a tar ({first_line(error)})") from None


def tar_stream(stream: BinaryIO) -> tarfile.TarFile:
    """A tar read front to back: stream mode never seeks (a URL's shard cannot)."""
    return tarfile.open(fileobj=stream, mode="r|")


def good_positions(count: int, left_out: list[int], first: int, end: int) -> Collection[int]:
    """The member positions of good samples FIRST..END-1 (with --skip-bad-images, the
    positions LEFT_OUT are not counted)."""
    if not left_out:
        return range(first, end)
    skipped = set(left_out)
    return frozenset([position for position in range(count) if position not in skipped][first:end])


def grouped(
    tar: tarfile.TarFile, wanted: Container[int]
) -> Iterator[tuple[int, str, dict[str, bytes]]]:
    """(position, key, {suffix: bytes}) for each sample in the tar, in order; the bytes are
    read only for the positions WANTED (the others' are passed over by the tar reader)."""
    position, key = -1, None
    members: dict[str, bytes] = {}
    for member in tar:
        if not member.isfile():
            continue
        member_name, suffix = member_key(member.name)
        if member_name != key:
            if key is not None:
                yield position, key, members
            position, key, members = position + 1, member_name, {}
        if position in wanted:
            handle = tar.extractfile(member)
            members[suffix] = handle.read() if handle is not None else b""
    if key is not None:
        yield position, key, members


def raw_sample(
    store: ShardStore,
    table: ShardTable,
    shard: int,
    position: int,
    key: str,
    members: dict[str, bytes],
) -> RawSample:
    name = table.names[shard]
    images = [suffix for suffix in members if suffix != LABEL_SUFFIX]
    try:
        label = int(members[LABEL_SUFFIX].decode())
    except (KeyError, ValueError):
        raise damaged(store, name, f"has no class number for {key}") from None
    if table.classes and not 0 <= label < table.classes:
        said = f"gives {key} class number {label}, and the index names {table.classes} classes"
        raise damaged(store, name, f"{said} (0 to {table.classes - 1})")
    if len(images) != 1:
        raise damaged(store, name, f"holds {len(images)} images for {key}, not one")
    number = table.firsts[shard] + position
    return RawSample(number, f"{name}:{key}", members[images[0]], label)


def stream_inputs(store: ShardStore, table: ShardTable, plan: EpochPlan, stream: int):
    """STREAM's samples in reading order, before its shuffle buffer."""
    for shard, first, end in stream_spans(table, plan, stream):
        yield from shard_samples(store, table, shard, first, end)


def piece_samples(
    store: ShardStore, table: ShardTable, plan: EpochPlan, piece: Piece
) -> Iterator[RawSample]:
    """Outputs first..end-1 of the piece's stream: the stream replayed from its start through
    its seeded buffer, the outputs before FIRST read and dropped (never decoded)."""
    stream, first, end = piece
    inputs = stream_inputs(store, table, plan, stream)
    outputs = shuffled(inputs, plan.buffer, stream_generator(plan, stream))
    yield from islice(outputs, first, end)


def part_samples(
    store: ShardStore, table: ShardTable, plan: EpochPlan, part: list[Piece]
) -> Iterator[RawSample]:
    """A loader worker's part: its pieces' samples, in order."""
    for piece in part:
        yield from piece_samples(store, table, plan, piece)


class MemberBytes(io.BytesIO):
    """A member's bytes where ddpcli.data.decode takes a file: PIL opens either, and a
    message names it as `shard:key`, where a file would be named by its path."""

    def __init__(self, data: bytes, name: str) -> None:
        super().__init__(data)
        self.member_name = name

    def __str__(self) -> str:
        return self.member_name
