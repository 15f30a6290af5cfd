"""An epoch over shards, planned from the index alone: no per-sample array anywhere.

The split's shards are read in an order drawn from (seed, epoch); their samples, concatenated
in that order, are the epoch's sample space [0, N). At the epoch's start that space is cut
into W x K contiguous streams (W ranks, K loader workers per rank, the rank's main process
counting as one when it has no workers): first into W rank shares of N // W samples (the
first N % W one more), then each share into K as evenly. The cut is by samples, not by
shards, so a stream may begin and end inside a shard, and any number of shards serves any
world (a stream that begins mid-shard reads past the members before its first).

Each stream passes its samples through a shuffle buffer seeded from (seed, epoch, stream);
its outputs are numbered 0, 1, ... A piece (stream, first, end) is that stream's outputs
first..end-1; a fresh epoch is every stream whole. Where an epoch stands is the list of
pieces not yet trained (O(streams), with the order and the streams: `EpochPlan`), which any
world deals again (`deal`): the pieces, in order, cut into W' x K' contiguous parts. A piece
that starts past its stream's first output is produced by replaying the stream from its
start through its seeded buffer (reading the bytes, not decoding them) and keeping outputs
first..end-1.

Seeded draws use Python's `random.Random.random()`, whose sequence for a seed Python
guarantees across versions; the shard order is stored in the checkpoint anyway.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from ddpcli.data.shards.index import SplitIndex

Piece = tuple[int, int, int]  # (stream, first output, end output)
Item = TypeVar("Item")


@dataclass(frozen=True)
class ShardTable:
    """A split's shards as the reader needs them: names, samples, each shard's first sample
    number (its place in the index's order: a sample's number is the shard's first plus its
    member's position), with --skip-bad-images the positions of members left out, and the
    number of classes the index names (a member's class number must be below it)."""

    names: list[str]
    counts: list[int]
    firsts: list[int]
    left_out: dict[int, list[int]] = field(default_factory=dict)  # shard -> sorted positions
    classes: int = 0  # 0: class numbers not checked

    def good(self, shard: int) -> int:
        """The samples of SHARD that are read (all but those left out)."""
        return self.counts[shard] - len(self.left_out.get(shard, ()))

    @property
    def samples(self) -> int:
        return sum(self.good(shard) for shard in range(len(self.names)))


def shard_table(split: SplitIndex, left_out: dict[int, list[int]] | None = None) -> ShardTable:
    counts = [record.samples for record in split.shards]
    firsts, total = [], 0
    for count in counts:
        firsts.append(total)
        total += count
    names = [record.name for record in split.shards]
    return ShardTable(names, counts, firsts, dict(left_out or {}), len(split.classes))


def seeded_random(*parts: int | str) -> random.Random:
    """A generator for PARTS (seed, epoch, stream ...): the same draws on every machine."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def shard_order(shards: int, seed: int, epoch: int) -> list[int]:
    """The epoch's reading order of the shards: a Fisher-Yates shuffle seeded from
    (seed, epoch)."""
    generator = seeded_random("shards", seed, epoch)
    order = list(range(shards))
    for last in range(shards - 1, 0, -1):
        other = int(generator.random() * (last + 1))
        order[last], order[other] = order[other], order[last]
    return order


def even_lengths(total: int, parts: int) -> list[int]:
    """TOTAL cut into PARTS lengths, the first TOTAL % PARTS one longer (as
    DistributedSampler's ranks are: rank r holds positions r, r + W, ...)."""
    return [total // parts + (part < total % parts) for part in range(parts)]


def part_lengths(total: int, ranks: int, workers: int) -> list[int]:
    """TOTAL cut into RANKS shares, then each share into WORKERS parts: rank r's parts are
    r x WORKERS ... r x WORKERS + WORKERS - 1."""
    return [
        length for share in even_lengths(total, ranks) for length in even_lengths(share, workers)
    ]


@dataclass
class EpochPlan:
    """What every reader of an epoch agrees on: the shard order, each stream's range of the
    epoch's samples, the shuffle buffer's length and the seed. Plain data (JSON)."""

    seed: int
    epoch: int
    order: list[int]
    streams: list[tuple[int, int]]
    buffer: int

    def stream_length(self, stream: int) -> int:
        start, end = self.streams[stream]
        return end - start

    def document(self) -> dict[str, Any]:
        return asdict(self)


def plan_from_document(document: dict[str, Any]) -> EpochPlan:
    return EpochPlan(
        seed=int(document["seed"]),
        epoch=int(document["epoch"]),
        order=[int(shard) for shard in document["order"]],
        streams=[(int(start), int(end)) for start, end in document["streams"]],
        buffer=int(document["buffer"]),
    )


def fresh_plan(
    table: ShardTable, seed: int, epoch: int, ranks: int, workers: int, buffer: int
) -> EpochPlan:
    """EPOCH's plan at a world of RANKS x WORKERS streams."""
    streams, start = [], 0
    for length in part_lengths(table.samples, ranks, workers):
        streams.append((start, start + length))
        start += length
    return EpochPlan(seed, epoch, shard_order(len(table.names), seed, epoch), streams, buffer)


def whole_streams(plan: EpochPlan) -> list[Piece]:
    """A fresh epoch's pieces: every stream, whole."""
    return [(stream, 0, plan.stream_length(stream)) for stream in range(len(plan.streams))]


def pieces_length(pieces: Iterable[Piece]) -> int:
    return sum(end - first for _, first, end in pieces)


def split_pieces(pieces: list[Piece], lengths: list[int]) -> list[list[Piece]]:
    """PIECES, in order, cut into consecutive parts of LENGTHS outputs (a piece may be split)."""
    parts: list[list[Piece]] = []
    queue = list(reversed(pieces))
    for length in lengths:
        part: list[Piece] = []
        while length:
            stream, first, end = queue.pop()
            taken = min(length, end - first)
            part.append((stream, first, first + taken))
            if first + taken < end:
                queue.append((stream, first + taken, end))
            length -= taken
        parts.append(part)
    return parts


def deal(pieces: list[Piece], ranks: int, workers: int) -> list[list[list[Piece]]]:
    """The pieces cut into RANKS x WORKERS parts: [rank][worker] -> that part's pieces."""
    parts = split_pieces(
        [piece for piece in pieces if piece[2] > piece[1]],
        part_lengths(pieces_length(pieces), ranks, workers),
    )
    return [parts[rank * workers : (rank + 1) * workers] for rank in range(ranks)]


def after_consumed(parts: list[list[Piece]], consumed: list[int]) -> list[Piece]:
    """What is left of PARTS once the first CONSUMED[k] outputs of part k were trained."""
    left: list[Piece] = []
    for part, done in zip(parts, consumed, strict=True):
        rest = split_pieces(part, [done, pieces_length(part) - done])[1]
        left.extend(rest)
    return left


def stream_spans(table: ShardTable, plan: EpochPlan, stream: int) -> Iterator[tuple[int, int, int]]:
    """The shards STREAM reads, in order: (shard, first good sample, end good sample), the
    good samples counted inside the shard (those --skip-bad-images left out are not)."""
    start, end = plan.streams[stream]
    reached = 0
    for shard in plan.order:
        good = table.good(shard)
        if reached + good > start and reached < end:
            yield shard, max(0, start - reached), min(good, end - reached)
        reached += good
        if reached >= end:
            return


def shuffled(items: Iterable[Item], buffer: int, generator: random.Random) -> Iterator[Item]:
    """ITEMS through a shuffle buffer of BUFFER: once it is full each new item takes the
    place of one drawn at random, which is handed out; at the end the rest, drawn at random.
    The order depends on the items' count and the generator only, never on their contents."""
    held: list[Item] = []
    for item in items:
        if len(held) < buffer:
            held.append(item)
            continue
        drawn = int(generator.random() * buffer)
        yield held[drawn]
        held[drawn] = item
    while held:
        drawn = int(generator.random() * len(held))
        held[drawn], held[-1] = held[-1], held[drawn]
        yield held.pop()


def stream_generator(plan: EpochPlan, stream: int) -> random.Random:
    return seeded_random("buffer", plan.seed, plan.epoch, stream)
