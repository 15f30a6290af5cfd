"""Where an epoch stands, in a form any world can continue from.

DistributedSampler deals the epoch's order to the ranks in turn (rank r takes positions
r, r + W, r + 2W, ...), and so does --ra-reps' sampler; so after k micro-batches of B
images on each of W ranks, the samples trained are exactly the order's first k x B x W
positions, whatever W is. That one number, the global sample offset, is what a checkpoint
records. A resume at another world (or another per-process batch) deals the positions from
there to the end of the order to its own ranks the same way, each to exactly one rank, so
no sample of the interrupted epoch is trained twice.

The re-dealt rest is trained to the end of the set, none of it left out: each rank's
micro-batches are full but its last, which also takes the rank's share of what no full
global batch holds (B to 2B - 1 keys, plus one on some ranks). Every rank still runs the
same number of micro-batches, as DDP needs. A rest shorter than one global batch is one
micro-batch of what each rank holds; the one exception: when some rank would hold fewer
than 2 samples (BatchNorm's least, in training), that rest is left out, and the resume's
header says so. The uninterrupted epoch may have dropped its own last, partial
global batch (ddpcli.data.pipeline); the re-dealt one trains those few instead: a
checkpoint does not know the world the epoch began at, and the set's end is the same for
every world. No padding either: a repeated sample would be trained twice.

A mid-rest checkpoint always falls before the last micro-batch, so its offset is still
start + k x B x W: the folded tail changes only where the rest ends.
"""

from __future__ import annotations

import torch


def epoch_order(size: int, seed: int, epoch: int, reps: int = 1) -> list[int]:
    """The epoch's keys in the order the ranks are dealt them, before any padding: the
    permutation DistributedSampler draws (seed + epoch), or with --ra-reps the repeated
    keys RASampler deals (`repetition x size + index`), cut to SIZE as its epoch is."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)  # what set_epoch makes DistributedSampler use
    order = torch.randperm(size, generator=generator).tolist()
    if reps == 1:
        return order
    return [copy * size + index for index in order for copy in range(reps)][:size]


def samples_trained(start: int, batch_in_epoch: int, per_gpu_batch: int, world_size: int) -> int:
    """The global sample offset after BATCH_IN_EPOCH full micro-batches at this world, dealt
    from position START of the epoch's order (0 unless a resume re-dealt the epoch). Inside
    a re-dealt rest only its last micro-batch is longer, and no checkpoint falls after it."""
    return start + batch_in_epoch * per_gpu_batch * world_size


# BatchNorm in training needs 2 values per channel: a micro-batch of 1 would fail the step.
LEAST_BATCH = 2


def remaining_steps(size: int, start: int, world_size: int, per_gpu_batch: int) -> int:
    """Micro-batches each rank gets when the order's positions from START on are dealt over
    WORLD_SIZE ranks: the same on every rank, or DDP would wait on a missing one. The tail
    folds into the last; a rest shorter than one global batch is one micro-batch, or none
    when a rank would hold fewer than LEAST_BATCH samples."""
    least_share = (size - start) // world_size  # every rank holds this many, some one more
    full = least_share // per_gpu_batch
    if full:
        return full
    return 1 if least_share >= LEAST_BATCH else 0


def remaining_batch_sizes(
    size: int, start: int, world_size: int, rank: int, per_gpu_batch: int
) -> list[int]:
    """This rank's micro-batch lengths for the rest of the epoch: PER_GPU_BATCH each, but the
    last, which holds all the rank's keys the others leave. Ranks' last micro-batches may
    differ by one sample: DDP averages each rank's mean gradient, so a sample there weighs a
    little less than one on a shorter rank, and no sample is dropped or repeated for it."""
    steps = remaining_steps(size, start, world_size, per_gpu_batch)
    if not steps:
        return []
    share = len(range(start + rank, size, world_size))
    return [per_gpu_batch] * (steps - 1) + [share - (steps - 1) * per_gpu_batch]


def remaining_shard(
    order: list[int], start: int, world_size: int, rank: int, per_gpu_batch: int
) -> list[int]:
    """This rank's keys for the rest of the epoch: positions START + RANK, START + RANK + W,
    ... of ORDER, all of them (or none, see remaining_steps)."""
    sizes = remaining_batch_sizes(len(order), start, world_size, rank, per_gpu_batch)
    return order[start + rank :: world_size][: sum(sizes)]


def left_out(size: int, start: int, world_size: int, per_gpu_batch: int) -> int:
    """Samples after START that no rank trains: all of them when they fill no global batch
    and some rank would hold fewer than LEAST_BATCH, else none."""
    return 0 if remaining_steps(size, start, world_size, per_gpu_batch) else size - start


def split_in_batches(count: int, batch_size: int, drop_last: bool) -> list[int]:
    """The lengths of COUNT samples' batches: full ones, then the partial rest unless
    DROP_LAST (training's rule, as DataLoader's drop_last)."""
    lengths = [batch_size] * (count // batch_size)
    if count % batch_size and not drop_last:
        lengths.append(count % batch_size)
    return lengths
