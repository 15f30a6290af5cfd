"""How the model is wrapped across devices: the strategy.

- `ddp` (the default): one process per device, DistributedDataParallel; each rank holds a
  full replica and gradients are all-reduced in buckets while backward still runs.
- `dp`: one process drives every listed GPU with nn.DataParallel. Each step it copies the
  weights to every GPU, splits the batch, and gathers all outputs on GPU 0, which therefore
  works and holds more than the others.
- `balanced-dp`: DataParallel with a smaller share for GPU 0 (`--gpu0-batch`), the
  BalancedDataParallel of the DDP tutorials: 2+3+3 for a batch of 8 on three GPUs.

The legacy modes exist so that a user can measure why DDP is the default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel, comm

from ddpcli.config.plan import RunPlan
from ddpcli.dist import DistContext
from ddpcli.training.compression import PowerSGD, register_compression

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # fp32: no autocast


def balanced_split(batch: int, gpus: int, gpu0_batch: int) -> list[int]:
    """Samples per GPU for one batch: GPU 0 takes `gpu0_batch`, the others share the rest
    evenly, the first of them one more when it does not divide. A batch too small for that
    (the last of an epoch) is split evenly instead, and GPUs left with nothing are dropped.

    >>> balanced_split(8, 3, 2)
    [2, 3, 3]
    """
    if gpus < 1 or batch < 0 or gpu0_batch < 0:
        raise ValueError(f"no split of {batch} over {gpus} GPUs with {gpu0_batch} on GPU 0")
    if gpus == 1:
        return [batch] if batch else []
    rest = batch - gpu0_batch
    if rest < gpus - 1:
        unit, extra = divmod(batch, gpus)
        shares = [unit + (1 if gpu < extra else 0) for gpu in range(gpus)]
    else:
        unit, extra = divmod(rest, gpus - 1)
        shares = [gpu0_batch] + [unit + (1 if gpu < extra else 0) for gpu in range(gpus - 1)]
    return [share for share in shares if share]


def dataparallel_split(batch: int, gpus: int) -> list[int]:
    """nn.DataParallel's own split (torch.chunk): 8 over three GPUs is 3+3+2."""
    unit = -(-batch // gpus)
    return [min(unit, batch - start) for start in range(0, batch, unit)] if batch else []


def batch_split(strategy: str, batch: int, gpus: int, gpu0_batch: int | None) -> list[int]:
    """Samples per GPU of one batch under a single-process strategy."""
    if strategy == "balanced-dp":
        return balanced_split(batch, gpus, require_gpu0_batch(gpu0_batch))
    return dataparallel_split(batch, gpus)


def require_gpu0_batch(gpu0_batch: int | None) -> int:
    """TrainConfig refuses balanced-dp without --gpu0-batch; None here is a caller's bug."""
    if gpu0_batch is None:
        raise ValueError("balanced-dp needs gpu0_batch, GPU 0's share of each batch")
    return gpu0_batch


class PrecisionDataParallel(nn.DataParallel):
    """nn.DataParallel whose replicas run as the run is configured. torch's parallel_apply
    enables autocast in each replica's thread without a dtype, and a thread's dtype is its
    own: the replicas would run fp16 under bf16 (with no GradScaler). Its replicate copies
    the weights through a flat buffer, which returns them contiguous: the convolutions
    would lose channels_last."""

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int] | None,
        autocast: tuple[str, torch.dtype] | None = None,
        channels_last: bool = False,
    ) -> None:
        super().__init__(module, device_ids=device_ids)
        self.autocast = autocast
        self.channels_last = channels_last

    def replicate(self, module: nn.Module, device_ids: Sequence[int | torch.device]) -> Any:
        replicas = super().replicate(module, device_ids)
        if self.channels_last:
            for replica in replicas:
                keep_channels_last(replica)
        return replicas

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any):
        if self.autocast is not None:
            replicas = [AutocastReplica(replica, *self.autocast) for replica in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)


class AutocastReplica(nn.Module):
    """A replica whose forward enters autocast with the run's dtype, on its own thread."""

    def __init__(self, replica: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.replica, self.device_type, self.dtype = replica, device_type, dtype

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.replica(*inputs, **kwargs)


def keep_channels_last(replica: nn.Module) -> None:
    """The replica's 4-D weights back in channels_last (a differentiable copy, so gradients
    still reach the module's own parameters)."""
    for module in replica.modules():
        copies = getattr(module, "_former_parameters", {})
        for name, weight in list(copies.items()):
            if weight.dim() == 4 and not weight.is_contiguous(memory_format=torch.channels_last):
                weight = weight.contiguous(memory_format=torch.channels_last)
                setattr(module, name, weight)
                copies[name] = weight


class BalancedDataParallel(PrecisionDataParallel):
    """PrecisionDataParallel whose scatter gives GPU 0 `gpu0_batch` samples of each batch."""

    def __init__(
        self,
        gpu0_batch: int,
        module: nn.Module,
        device_ids: list[int],
        autocast: tuple[str, torch.dtype] | None = None,
        channels_last: bool = False,
    ) -> None:
        super().__init__(module, device_ids, autocast, channels_last)
        self.gpu0_batch = gpu0_batch

    def scatter(
        self,
        inputs: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        device_ids: Sequence[int | torch.device],
    ) -> tuple[tuple[tuple[torch.Tensor], ...], tuple[dict[str, Any], ...]]:
        if kwargs or len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor):
            raise TypeError("BalancedDataParallel scatters a single batch tensor")
        batch = inputs[0]
        shares = balanced_split(batch.shape[self.dim], len(device_ids), self.gpu0_batch)
        # The images need no gradient, so the plain (non-autograd) scatter is enough.
        pieces = comm.scatter(batch, device_ids[: len(shares)], chunk_sizes=shares, dim=self.dim)
        return tuple((piece,) for piece in pieces), tuple({} for _ in pieces)


@dataclass
class ParallelModel:
    """The model as the strategy wrapped it, and the state its gradient hook keeps between
    steps (PowerSGD's, for the checkpoint; None without one): its owner holds both."""

    model: nn.Module
    compression: PowerSGD | None = None


def parallelize(model: nn.Module, cfg: RunPlan, ctx: DistContext) -> ParallelModel:
    """The model on ctx.device, wrapped for the configured strategy."""
    if cfg.strategy == "ddp":
        if not ctx.distributed:
            return ParallelModel(model)
        ddp = DistributedDataParallel(
            model,
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            bucket_cap_mb=cfg.bucket_cap_mb,
            find_unused_parameters=cfg.find_unused_parameters,
            static_graph=cfg.static_graph,
        )
        return ParallelModel(ddp, register_compression(ddp, cfg))
    device_ids = list(range(torch.cuda.device_count()))
    autocast = (
        (ctx.device.type, AUTOCAST_DTYPES[cfg.precision])
        if cfg.precision in AUTOCAST_DTYPES
        else None
    )
    channels_last = ctx.device.type == "cuda"  # as build_parallel_model lays the model out
    if cfg.strategy == "dp":
        return ParallelModel(PrecisionDataParallel(model, device_ids, autocast, channels_last))
    gpu0_batch = require_gpu0_batch(cfg.gpu0_batch)
    balanced = BalancedDataParallel(gpu0_batch, model, device_ids, autocast, channels_last)
    return ParallelModel(balanced)


def wrap_model(model: nn.Module, cfg: RunPlan, ctx: DistContext) -> nn.Module:
    """The wrapped model alone, for code that never checkpoints its hook's state."""
    return parallelize(model, cfg, ctx).model


def unwrap(model: nn.Module) -> nn.Module:
    if isinstance(model, (DistributedDataParallel, nn.DataParallel)):
        return model.module
    return model


def model_devices(model: nn.Module, ctx: DistContext) -> list[torch.device]:
    """The devices this process trains on: every GPU for DataParallel, else its own."""
    if isinstance(model, nn.DataParallel):
        return [torch.device("cuda", index) for index in model.device_ids]
    return [ctx.device]
