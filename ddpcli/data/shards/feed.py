"""One rank's batches from shards (`--dataset shards`): the epoch's plan dealt to the ranks
and their loader workers, each worker streaming its part (ddpcli.data.shards.stream) and
decoding and augmenting each sample as the folder path does, its draws keyed by the
sample's number in the index (the same on any world), and the rank's batches cut from what
its workers hand over, knowing exactly which outputs each batch trained.

Every rank runs the same number of micro-batches, known from the index before the first
step: its share of the epoch is N // W samples (some ranks one more), split in micro-batches
of --per-gpu-batch but the last, which takes the share's rest (the rule of
ddpcli.data.resharding for a re-dealt epoch, used here for every epoch): every sample is
trained once per epoch, none dropped, none repeated, no Join. Validation: the val split's
samples, each on exactly one rank, unpadded.

Workers are started for each epoch (not kept): each one streams the part it was given, which
a persistent worker would not see change.
"""

from __future__ import annotations

import functools
import os
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch

from ddpcli.config.data import BUFFER_BOUNDS, BUFFER_MEMORY_FRACTION
from ddpcli.data.encoded import EncodedBatch, EncodedItem, EncodedMembers, joined
from ddpcli.data.loader import FolderDataset, Stage, die_with_rank, tmpdir_too_long
from ddpcli.data.resharding import LEAST_BATCH, remaining_batch_sizes, remaining_steps
from ddpcli.data.shards.checks import check_resumed_index
from ddpcli.data.shards.index import split_stamp
from ddpcli.data.shards.plan import (
    EpochPlan,
    Piece,
    ShardTable,
    after_consumed,
    deal,
    fresh_plan,
    part_lengths,
    pieces_length,
    plan_from_document,
    shard_table,
    whole_streams,
)
from ddpcli.data.shards.storage import ShardStore, shard_store
from ddpcli.data.shards.stream import MemberBytes, RawSample, part_samples
from ddpcli.dist import DistContext, all_gather_object, all_reduce_max
from ddpcli.errors import runtime_error
from ddpcli.process import multiprocessing_sockets_fit
from ddpcli.ui import byte_size


class MemberImages(FolderDataset):
    """A shard member decoded and augmented as an image file of the folder path is
    (ddpcli.data.decode: reduced-scale JPEG decoding, the same crops and flips), its draws
    keyed by (sample number, epoch)."""

    def __init__(self, image_size: int, seed: int, augment: Any, **recipe: Any) -> None:
        super().__init__([], image_size, seed, augment, **recipe)

    def image(self, sample: RawSample, epoch: int) -> torch.Tensor:
        # One sample held at a time: `self[(number, epoch)]` reads it (number % 1 == 0).
        self.samples = [(cast(Path, MemberBytes(sample.image, sample.name)), sample.label)]
        image, _ = self[(sample.number, epoch)]
        return image


class ShardStreams(torch.utils.data.IterableDataset):
    """The parts of one rank: each loader worker (or the rank itself, without workers)
    streams its part and hands over chunks of up to CHUNK decoded samples, each chunk
    with the worker's number."""

    def __init__(
        self,
        store: ShardStore,
        table: ShardTable,
        images: MemberImages | EncodedMembers,
        chunk: int,
    ) -> None:
        self.store, self.table, self.images, self.chunk = store, table, images, chunk
        self.plan: EpochPlan | None = None
        self.parts: list[list[Piece]] = []

    def set_parts(self, plan: EpochPlan, parts: list[list[Piece]]) -> None:
        self.plan, self.parts = plan, parts

    def __iter__(self) -> Iterator[tuple[Any, torch.Tensor, torch.Tensor, int]]:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        if self.plan is None or worker >= len(self.parts):
            return
        held: list[RawSample] = []
        images: list[Any] = []
        for sample in part_samples(self.store, self.table, self.plan, self.parts[worker]):
            held.append(sample)
            images.append(self.images.image(sample, self.plan.epoch))
            if len(held) == self.chunk:
                yield chunk_of(held, images, worker, self.plan.epoch)
                held, images = [], []
        if held:
            yield chunk_of(held, images, worker, self.plan.epoch)


def chunk_of(
    samples: list[RawSample], images: list[Any], worker: int, epoch: int
) -> tuple[Any, torch.Tensor, torch.Tensor, int]:
    """Up to CHUNK samples: their pixels stacked, or (--decode gpu) their EncodedItems in
    one EncodedBatch; their labels, numbers and the worker's number."""
    labels = torch.tensor([sample.label for sample in samples], dtype=torch.int64)
    numbers = [sample.number for sample in samples]
    if isinstance(images[0], EncodedItem):
        batch: Any = EncodedBatch.of(images, numbers, epoch)
    else:
        batch = torch.stack(images)
    return batch, labels, torch.tensor(numbers, dtype=torch.int64), worker


class LatestKeys:
    """The sample numbers of the batch just handed out, read as the slice of the epoch's
    keys that TracedBatches and ErasedBatches take (they slice each batch's as it comes):
    no list of the epoch's keys is kept."""

    def __init__(self) -> None:
        self.start = 0
        self.keys: list[int] = []

    def hand_out(self, keys: list[int]) -> None:
        self.start, self.keys = self.start + len(self.keys), keys

    def __getitem__(self, span: slice) -> list[int]:
        if span.start != self.start:
            raise IndexError(f"keys {span.start}.. asked, the latest batch's begin at {self.start}")
        return self.keys


class RankBatches:
    """The rank's micro-batches, of SIZES samples, cut from the chunks its workers hand
    over (the DataLoader serves them in turn) and made the device's batch by STAGE; which of
    each part's outputs every batch took is counted, so a checkpoint knows exactly what was
    trained."""

    def __init__(
        self,
        loader: torch.utils.data.DataLoader,
        sizes: list[int],
        parts: int,
        stage: Stage,
    ) -> None:
        self.loader, self.sizes, self.parts, self.stage = loader, sizes, parts, stage
        self.keys = LatestKeys()
        # After each batch handed out: how many outputs of each part were trained so far.
        self.consumed_after: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if not self.sizes:
            return
        chunks = iter(self.loader)
        held: deque[tuple[Any, torch.Tensor, torch.Tensor, int]] = deque()
        consumed = [0] * self.parts
        for size in self.sizes:
            taken: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
            while size:
                if not held:
                    held.append(self.next_chunk(chunks))
                images, labels, numbers, worker = held.popleft()
                count = min(size, len(labels))
                taken.append((images[:count], labels[:count], numbers[:count]))
                if count < len(labels):
                    held.appendleft((images[count:], labels[count:], numbers[count:], worker))
                consumed[worker] += count
                size -= count
            self.consumed_after.append(list(consumed))
            self.keys.hand_out(torch.cat([numbers for _, _, numbers in taken]).tolist())
            images = joined([images for images, _, _ in taken])
            yield self.stage(images, torch.cat([labels for _, labels, _ in taken]))

    def next_chunk(self, chunks: Iterator[Any]) -> tuple[Any, torch.Tensor, torch.Tensor, int]:
        try:
            images, labels, numbers, worker = next(chunks)
        except StopIteration:
            raise runtime_error(
                "the shard streams ended before the epoch's batches were filled: the shards "
                "hold fewer samples than their index says; run `ddpcli data verify`"
            ) from None
        return images, labels, numbers, int(worker)


def default_buffer(table: ShardTable, split_bytes: int, local_streams: int) -> int:
    """Samples per stream: BUFFER_MEMORY_FRACTION of the node's available memory over its
    streams, in samples of the split's mean size, within BUFFER_BOUNDS."""
    mean_bytes = max(1, split_bytes // max(1, table.samples))
    available = available_memory() or 8 << 30
    fit = int(available * BUFFER_MEMORY_FRACTION / max(1, local_streams) / mean_bytes)
    return max(BUFFER_BOUNDS[0], min(BUFFER_BOUNDS[1], fit))


def available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class ShardFeed:
    """The train and val batches of one rank, from shards; where the epoch stands, for a
    checkpoint; the rest of an epoch a checkpoint left, dealt to this world."""

    def __init__(
        self,
        splits: Any,  # ddpcli.data.sets.ShardSplits
        cfg: Any,  # ddpcli.config.TrainConfig
        ctx: DistContext,
        workers: int,
        train_images: MemberImages | EncodedMembers,
        val_images: MemberImages | EncodedMembers,
        train_stage: Stage,
        val_stage: Stage,
    ) -> None:
        """TRAIN_IMAGES and VAL_IMAGES: what the workers make of each member (pixels, or
        --decode gpu's bytes); TRAIN_STAGE and VAL_STAGE: what the rank makes of it."""
        if workers and not multiprocessing_sockets_fit():
            raise tmpdir_too_long()
        self.cfg, self.ctx, self.workers = cfg, ctx, workers
        self.train_stage, self.val_stage = train_stage, val_stage
        self.parts = max(1, workers)  # the rank's streams: its workers, or itself
        self.store = shard_store(splits.location)
        train, val = splits.index.splits["train"], splits.index.splits["val"]
        self.train_table = shard_table(train, splits.left_out.get("train"))
        self.val_table = shard_table(val, splits.left_out.get("val"))
        self.split_bytes = train.bytes
        self.train_stamp = split_stamp(train)  # a position is only good for these shards
        self.buffer, self.buffer_given = self.agreed_buffer(cfg.shuffle_buffer)
        chunk = cfg.per_gpu_batch
        self.train_streams = ShardStreams(self.store, self.train_table, train_images, chunk)
        self.val_streams = ShardStreams(self.store, self.val_table, val_images, chunk)
        self.resumed: dict[str, Any] | None = None  # a checkpoint's stream position
        self.current: RankBatches | None = None
        self.current_plan: EpochPlan | None = None
        self.current_parts: list[list[Piece]] = []

    def agreed_buffer(self, given: int | None) -> tuple[int, bool]:
        """--shuffle-buffer, or the default from each node's memory, the least of them (every
        rank must plan the same streams)."""
        if given is not None:
            return given, True
        local_streams = self.ctx.local_world_size * self.parts
        mine = default_buffer(self.train_table, self.split_bytes, local_streams)
        least = -all_reduce_max(torch.tensor([-float(mine)]), self.ctx).item()
        return int(least), False

    # --- sizes and steps
    @property
    def train_size(self) -> int:
        return self.train_table.samples

    @property
    def val_size(self) -> int:
        return self.val_table.samples

    def steps(self, start: int = 0) -> int:
        """Micro-batches per rank: of a whole epoch, or (START > 0) of the rest a checkpoint
        left, which the resume deals from its stream position."""
        left = self.resumed_left() if start else self.train_size
        return remaining_steps(left, 0, self.ctx.world_size, self.cfg.per_gpu_batch)

    def resumed_left(self) -> int:
        if self.resumed is None:
            raise runtime_error("resumed inside a shards epoch without its stream position")
        return pieces_length(resumed_pieces(self.resumed))

    # --- training
    def train_batches(self, epoch: int, start: int = 0) -> RankBatches:
        ctx, batch = self.ctx, self.cfg.per_gpu_batch
        if start:
            plan, pieces = self.resumed_plan(epoch)
        else:
            plan = fresh_plan(
                self.train_table, self.cfg.seed, epoch, ctx.world_size, self.parts, self.buffer
            )
            pieces = whole_streams(plan)
        left = pieces_length(pieces)
        parts = deal(pieces, ctx.world_size, self.parts)[ctx.rank]
        sizes = remaining_batch_sizes(left, 0, ctx.world_size, ctx.rank, batch)
        self.train_streams.set_parts(plan, parts)
        self.current_plan, self.current_parts = plan, parts
        self.current = RankBatches(
            self.loader(self.train_streams), sizes, self.parts, self.train_stage
        )
        return self.current

    def resumed_plan(self, epoch: int) -> tuple[EpochPlan, list[Piece]]:
        if self.resumed is None:
            raise runtime_error("resumed inside a shards epoch without its stream position")
        plan = plan_from_document(self.resumed["plan"])
        if plan.epoch != epoch:
            raise runtime_error(
                f"the checkpoint's stream position is of epoch {plan.epoch + 1}, not {epoch + 1}"
            )
        return plan, resumed_pieces(self.resumed)

    def loader(self, streams: ShardStreams) -> torch.utils.data.DataLoader:
        workers = self.workers
        return torch.utils.data.DataLoader(
            streams,
            batch_size=None,
            num_workers=workers,
            pin_memory=self.ctx.device.type == "cuda",
            prefetch_factor=2 if workers else None,
            worker_init_fn=functools.partial(die_with_rank, os.getpid()),
        )

    def val_batches(self) -> RankBatches:
        """Each val sample on exactly one rank: the split cut as a fresh epoch's streams are,
        read in the index's order, unshuffled, in batches of --per-gpu-batch (the last one
        shorter), unpadded."""
        ctx, batch = self.ctx, self.cfg.per_gpu_batch
        streams, start = [], 0
        for length in part_lengths(self.val_size, ctx.world_size, self.parts):
            streams.append((start, start + length))
            start += length
        order = list(range(len(self.val_table.names)))
        plan = EpochPlan(self.cfg.seed, 0, order, streams, buffer=1)
        parts = deal(whole_streams(plan), ctx.world_size, self.parts)[ctx.rank]
        count = pieces_length([piece for part in parts for piece in part])
        sizes = [batch] * (count // batch) + ([count % batch] if count % batch else [])
        self.val_streams.set_parts(plan, parts)
        return RankBatches(self.loader(self.val_streams), sizes, self.parts, self.val_stage)

    # --- where the epoch stands
    def position(self, batch_in_epoch: int, epoch_start: int) -> dict[str, Any] | None:
        """The pieces of the epoch not yet trained, over every rank (a collective: every rank
        calls it at a save), with the epoch's plan; None at an epoch's start."""
        if not batch_in_epoch and not epoch_start:
            return None
        current, plan = self.current, self.current_plan
        if current is None or plan is None or batch_in_epoch > len(current.consumed_after):
            raise runtime_error(
                f"rank {self.ctx.rank}: a checkpoint at micro-batch {batch_in_epoch} of an "
                "epoch whose batches were not handed out"
            )
        consumed = (
            current.consumed_after[batch_in_epoch - 1] if batch_in_epoch else [0] * self.parts
        )
        mine = after_consumed(self.current_parts, consumed)
        pieces = [list(piece) for share in all_gather_object(mine, self.ctx) for piece in share]
        return {"plan": plan.document(), "pieces": pieces, "index": self.train_stamp}

    def follow(self, position: dict[str, Any] | None) -> None:
        """A resume's stream position: the rest of its epoch is dealt from it, over the
        shards it was saved with only (exit 2 on every rank otherwise)."""
        check_resumed_index(position, self.train_stamp, self.store, "the checkpoint")
        self.resumed = position

    # --- what the header says
    def describe_sizes(self) -> str:
        """`96 train samples per epoch, each once (each rank's last micro-batch takes the
        rest: 4 to 6)`."""
        world, batch = self.ctx.world_size, self.cfg.per_gpu_batch
        size = self.train_size
        lasts = self.last_batches(size)
        rest = f"each rank's last micro-batch takes its rest: {lasts}" if lasts else ""
        return f"{size} train samples per epoch, each once ({rest or f'{world} x {batch} fit'})"

    def last_batches(self, left: int) -> str:
        """`4 to 6`: the last micro-batch's lengths over the ranks, where not --per-gpu-batch."""
        world, batch = self.ctx.world_size, self.cfg.per_gpu_batch
        lasts = sorted(
            {
                (remaining_batch_sizes(left, 0, world, rank, batch) or [0])[-1]
                for rank in range(world)
            }
        )
        if lasts == [batch]:
            return ""
        return f"{lasts[0]} to {lasts[-1]}" if len(lasts) > 1 else str(lasts[0])

    def stream_line(self) -> str:
        """How an epoch is read: the order, the streams, the buffer, the remainder's rule."""
        world, shards = self.ctx.world_size, len(self.train_table.names)
        streams = world * self.parts
        who = f"{world} ranks x {self.parts} {'loader workers' if self.workers else 'rank process'}"
        mean_bytes = self.split_bytes // max(1, self.train_size)
        buffer_bytes = self.buffer * mean_bytes
        origin = (
            "--shuffle-buffer"
            if self.buffer_given
            else (
                f"default: 1/{round(1 / BUFFER_MEMORY_FRACTION)} of available memory over this "
                f"node's streams, {BUFFER_BOUNDS[0]} to {BUFFER_BOUNDS[1]}"
            )
        )
        split_by = (
            f"; {shards} shards for {streams} streams: split by samples, so a stream may begin "
            "and end inside a shard"
            if shards < streams
            else ""
        )
        return (
            f"shards: {shards} train shards read in a seeded order each epoch, cut into "
            f"{streams} streams ({who}){split_by}; shuffle buffer {self.buffer} samples per "
            f"stream (about {byte_size(buffer_bytes)} each; {origin}); every rank runs "
            f"{self.steps()} micro-batches, its last one holding the rest of its share"
        )

    def describe_rest(self, epoch: int, start: int) -> str:
        """`epoch 1: 36 of 96 samples trained before the resume; the other 60 dealt from the
        saved stream position over 2 ranks x 1 workers, 7 batches of 4 each, the last of
        them 6`."""
        world, batch = self.ctx.world_size, self.cfg.per_gpu_batch
        left = self.resumed_left()
        head = (
            f"epoch {epoch + 1}: {self.train_size - left} of {self.train_size} samples trained "
            f"before the resume; the other {left}"
        )
        steps = self.steps(start)
        if not steps:
            return (
                f"{head} left out (too few for a batch of {min(batch, LEAST_BATCH)} on each of "
                f"{world} ranks, the least a training batch holds)"
            )
        lasts = self.last_batches(left)  # "" when the tail needs no folding in
        folded = " (the tail folded in)" if lasts else ""
        if steps == 1:
            batches = f"one batch of {lasts or batch} each{folded}"
        else:
            batches = f"{steps} batches of {batch} each"
            batches += f", the last of them {lasts}{folded}" if lasts else ""
        return (
            f"{head} dealt from the saved stream position over {world} ranks x {self.parts} "
            f"streams, {batches}; each stream replays from its start, reading but not decoding"
        )


def resumed_pieces(position: dict[str, Any]) -> list[Piece]:
    return [(int(stream), int(first), int(end)) for stream, first, end in position["pieces"]]
