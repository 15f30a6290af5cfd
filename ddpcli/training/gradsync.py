"""Gradients and buffers made equal on every rank by ddpcli itself, for `--per-gpu-batch
auto`, whose backward passes all run under DDP's `no_sync` (ddpcli.training.microbatch).

As DDP's reducer does, the gradients go in buckets of `--bucket-cap-mb` (in the reverse
order of the parameters, roughly the order backward produces them), and a bucket's
all-reduce starts as soon as its last gradient of the step's last micro-batch is in, while
backward goes on. Unlike DDP's, a rank knows which buckets it has started: one that ran out
of memory starts the rest (whatever its gradients hold), so every rank starts every bucket,
in the same order, and the collective that follows, the ranks' agreement, is reached by all.
Only after it are the averaged gradients kept, or dropped with the step. The buffers
(BatchNorm's running statistics) then come from rank 0, as DDP's `broadcast_buffers` has
them."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ddpcli.dist import DistContext, broadcast_from_rank0


class GradientBuckets:
    """One rank's gradient all-reduce, bucket by bucket (see the module's docstring). Each
    parameter's gradient is a view into its bucket's flat buffer, as DDP's
    `gradient_as_bucket_view` makes it: backward accumulates in place, and a bucket is
    all-reduced where it lies, with no copy in or out."""

    def __init__(self, model: nn.Module, ctx: DistContext, bucket_cap_mb: float) -> None:
        self.model, self.ctx = model, ctx
        self.cap_bytes = int(bucket_cap_mb * 2**20)
        parameters = [p for p in model.parameters() if p.requires_grad]
        self.buckets = list(buckets(list(reversed(parameters)), self.cap_bytes))
        self.bucket_of = {id(p): index for index, bucket in enumerate(self.buckets) for p in bucket}
        self.flats = [
            torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype,
                        device=bucket[0].device)
            for bucket in self.buckets
        ] if ctx.distributed else []  # fmt: skip
        self.views = {
            id(p): view
            for bucket, flat in zip(self.buckets, self.flats, strict=True)
            for p, view in zip(bucket, views_of(flat, bucket), strict=True)
        }
        self.armed = False
        self.ready = [0] * len(self.buckets)
        self.next = 0  # the first bucket not yet started
        self.started: list[tuple[int, dist.Work | None]] = []
        if ctx.distributed:
            for parameter in parameters:
                parameter.register_post_accumulate_grad_hook(self.gradient_in)

    def zero(self) -> None:
        """Every gradient zero, and a view into its bucket again (an optimizer's
        zero_grad(set_to_none=True) lets them go)."""
        for flat in self.flats:
            flat.zero_()
        for bucket in self.buckets:
            for parameter in bucket:
                view = self.views.get(id(parameter))
                if view is not None and parameter.grad is not view:
                    parameter.grad = view

    def arm(self) -> None:
        """The step's last micro-batch comes: its gradients complete the buckets."""
        self.armed, self.ready, self.next, self.started = True, [0] * len(self.buckets), 0, []

    def gradient_in(self, parameter: torch.Tensor) -> None:
        if not self.armed:
            return
        self.ready[self.bucket_of[id(parameter)]] += 1
        while self.next < len(self.buckets) and self.ready[self.next] == len(
            self.buckets[self.next]
        ):
            self.start(self.next)

    def start_the_rest(self) -> None:
        """After the micro-batches, whether they ran or not: every bucket not yet started
        (its parameters unused in this rank's forward pass, or its backward cut short), in
        order: every rank starts them all."""
        if not self.ctx.distributed:
            return
        if not self.armed:
            self.arm()
        while self.next < len(self.buckets):
            self.start(self.next)
        self.armed = False

    def start(self, index: int) -> None:
        self.started.append((index, dist.all_reduce(self.flats[index], async_op=True)))
        self.next += 1

    def finish(self, keep: bool) -> None:
        """Wait for the buckets; KEEP: their averages are the gradients (a parameter unused
        on this rank gets the others', as DDP's find_unused_parameters has it), and the
        buffers rank 0's. Else they are left for the step run again to zero (`zero`)."""
        for index, work in self.started:
            if work is not None:
                work.wait()
            if keep:
                self.flats[index].div_(self.ctx.world_size)
        self.started = []
        if keep:
            broadcast_from_rank0(list(self.model.buffers()), self.ctx)


def views_of(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views into FLAT shaped as TENSORS, one after another."""
    views, offset = [], 0
    for tensor in tensors:
        views.append(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    return views


def buckets(tensors: list[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    """TENSORS in order, in runs of one dtype and device of at most CAP_BYTES (one tensor
    larger than it is a bucket of its own)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        mismatched = bucket and (
            tensor.dtype != bucket[0].dtype or tensor.device != bucket[0].device
        )
        if bucket and (mismatched or size + nbytes > cap_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        yield bucket
