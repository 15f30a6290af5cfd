"""Where an epoch stands, in a form any world can continue from.

DistributedSampler deals the epoch's order to the ranks in turn (rank r takes positions
r, r + W, r + 2W, ...), and so does --ra-reps' sampler; so after k micro-batches of B
images on each of W ranks, the samples trained are exactly the order's first k x B x W
positions, whatever W is. That one number, the global sample offset, is what a checkpoint
records. A resume at another world (or another per-process batch) deals the positions from
there to the end of the order to its own ranks the same way, each to exactly one rank, so
no sample of the interrupted epoch is trained twice.

Only full global batches are trained (an epoch's last, partial batch never is, see
ddpcli.data.pipeline): what is left of the epoch after the last full one, fewer than
B x W samples, is left out, and the resume's header says how many. No padding either: a
repeated sample would be trained twice.
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
    """The global sample offset after BATCH_IN_EPOCH micro-batches at this world, dealt from
    position START of the epoch's order (0 unless a resume re-dealt the epoch)."""
    return start + batch_in_epoch * per_gpu_batch * world_size


def remaining_steps(size: int, start: int, world_size: int, per_gpu_batch: int) -> int:
    """Full micro-batches each rank gets when the order's positions from START on are dealt
    over WORLD_SIZE ranks: the same on every rank, or DDP would wait on a missing one."""
    return (size - start) // world_size // per_gpu_batch


def remaining_shard(
    order: list[int], start: int, world_size: int, rank: int, per_gpu_batch: int
) -> list[int]:
    """This rank's keys for the rest of the epoch: positions START + RANK, START + RANK + W,
    ... of ORDER, as many as fill its full micro-batches."""
    steps = remaining_steps(len(order), start, world_size, per_gpu_batch)
    return order[start + rank :: world_size][: steps * per_gpu_batch]


def left_out(size: int, start: int, world_size: int, per_gpu_batch: int) -> int:
    """Samples after START that no full global batch holds: fewer than one global batch."""
    trained = remaining_steps(size, start, world_size, per_gpu_batch) * per_gpu_batch * world_size
    return size - start - trained
