"""Gradients and buffers made equal on every rank by hand, as DDP does in its backward pass:
for `--per-gpu-batch auto`, whose backward passes all run under `no_sync` so that a rank out
of memory can still reach the ranks' agreement (ddpcli.training.microbatch). The gradients
go in buckets of `--bucket-cap-mb`, all in flight at once; the buffers (BatchNorm's running
statistics) come from rank 0, as DDP's `broadcast_buffers` has them."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddpcli.dist import DistContext


def synchronize(model: nn.Module, ctx: DistContext, bucket_cap_mb: float) -> None:
    """MODEL's gradients averaged over the ranks, and its buffers set to rank 0's. A
    parameter without a gradient on this rank (unused in its forward pass) counts as zeros,
    as DDP's find_unused_parameters has it: every rank sends the same buckets."""
    if not ctx.distributed:
        return
    parameters = [p for p in model.parameters() if p.requires_grad]
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    grads = [p.grad for p in parameters if p.grad is not None]
    pending = []
    for bucket in buckets(grads, int(bucket_cap_mb * 2**20)):
        flat = _flatten_dense_tensors(bucket)
        pending.append((bucket, flat, dist.all_reduce(flat, async_op=True)))
    for bucket, flat, work in pending:
        assert work is not None
        work.wait()
        flat.div_(ctx.world_size)
        for grad, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            grad.copy_(synced)
    buffers = list(model.buffers())
    for bucket in buckets(buffers, int(bucket_cap_mb * 2**20)):
        flat = _flatten_dense_tensors(bucket)
        dist.broadcast(flat, src=0)
        for buffer, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            buffer.copy_(synced)


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
