"""Gradient compression, a detail of the DDP wrapping: `--grad-compression none|fp16|bf16|
powersgd[:RANK]`, the bytes each sends, and PowerSGD's state in the checkpoint.

- fp16, bf16: torch's compress hooks. One all-reduce per bucket of the gradients cast to
  half width (half the bytes), issued as DDP issues its own: correct on Gloo and NCCL.
- powersgd: ddpcli's own hook, computing what torch's `powerSGD_hook` computes (Vogels et
  al. 2019: each gradient matrix M sent as the factors P = M Q and Q = M^T P of rank RANK,
  with error feedback and warm-started Q). Torch's hook issues a bucket's second and third
  all-reduce from future callbacks, which run on Gloo's threads: two ranks may then issue
  different buckets' collectives in different orders, and Gloo pairs the wrong ones (a
  "collective mismatch" abort, docs/performance.md). Here each bucket's two all-reduces run
  inside the hook and are waited for, so every rank issues them in bucket order, on both
  backends; the price is that PowerSGD's communication overlaps less of the backward pass.
  Its state is kept per parameter, not per bucket: DDP rebuilds its buckets after the first
  step, and a resumed run's new DDP starts with other buckets (torch's state, keyed by bucket
  index, then fails on a size mismatch).

Replicas stay bit-identical: every rank applies P Q^T computed from the same all-reduced P
and Q by the same code, and the uncompressed tensors' same all-reduced mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from torch.nn.parallel import DistributedDataParallel

from ddpcli.config.plan import RunPlan
from ddpcli.config.train import powersgd_rank
from ddpcli.dist import DistContext

HALF_HOOKS = {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}
# torch's PowerSGD compresses a matrix only where its factors are under half its size.
MIN_COMPRESSION_RATE = 2
# A zero gradient column would divide by zero in Gram-Schmidt (torch's suggested epsilon).
ORTHOGONALIZATION_EPSILON = 1e-8
MB = 1_000_000


def register_compression(ddp: DistributedDataParallel, cfg: RunPlan) -> PowerSGD | None:
    """CFG's --grad-compression as DDP's communication hook (none: DDP's own all-reduce).
    Returns PowerSGD's state, which the checkpoint keeps; None for the stateless hooks."""
    if cfg.grad_compression in HALF_HOOKS:
        ddp.register_comm_hook(None, HALF_HOOKS[cfg.grad_compression])
    rank = powersgd_rank(cfg.grad_compression)
    if rank is None:
        return None
    state = PowerSGD(rank, cfg.powersgd_start_step, cfg.seed, parameter_keys(ddp.module))
    ddp.register_comm_hook(state, powersgd_hook)
    return state


def parameter_keys(module: nn.Module) -> dict[int, int]:
    """id(parameter) -> its index in module.parameters(): the same on every rank and run."""
    return {id(parameter): index for index, parameter in enumerate(module.parameters())}


def powersgd_hook(state: PowerSGD, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return state.reduce(bucket)


# DDP checks a hook's annotations against the objects themselves; this module's are strings.
powersgd_hook.__annotations__.update(
    bucket=dist.GradBucket, state=object, **{"return": torch.futures.Future[torch.Tensor]}
)


@dataclass
class PowerSGD:
    """One rank's PowerSGD: the hook's arithmetic and its state (error feedback and Q memory
    per compressed parameter, by parameter index; the steps it has reduced)."""

    rank: int
    start_step: int
    seed: int
    keys: dict[int, int]
    step: int = 0  # optimizer steps reduced: the hook runs on syncing micro-steps only
    errors: dict[int, torch.Tensor] = field(default_factory=dict)
    q_memory: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"powersgd:{self.rank}"

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self.step < self.start_step:  # one collective per bucket: DDP's order holds
            future = allreduce_hook(None, bucket)  # type: ignore[arg-type]
        else:
            self.compress_and_reduce(bucket)
            future = completed(bucket.buffer())
        if bucket.is_last():
            self.step += 1
        return future

    def compress_and_reduce(self, bucket: dist.GradBucket) -> None:
        """The bucket's gradients replaced by their mean over the ranks: exact for the small
        tensors, PowerSGD's rank-RANK approximation for the matrices."""
        world_size = dist.get_world_size()
        plain, matrices = [], []
        for parameter, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            if compressible(grad.shape, self.rank):
                matrices.append((self.keys[id(parameter)], grad, self.with_error(parameter, grad)))
            else:
                plain.append(grad)
        ps = [matrix @ self.q_for(key, matrix) for key, _, matrix in matrices]
        reduced = all_reduce_now([grad.reshape(-1) for grad in plain] + ps)
        for grad, total in zip(plain, reduced, strict=False):
            grad.copy_(total.view(grad.shape) / world_size)
        ps = [orthogonalized(p) for p in reduced[len(plain) :]]
        qs = all_reduce_now(
            [matrix.t() @ p for (_, _, matrix), p in zip(matrices, ps, strict=True)]
        )
        for (key, grad, matrix), p, q in zip(matrices, ps, qs, strict=True):
            q /= world_size
            mean = p @ q.t()
            self.errors[key] = matrix - mean  # what this rank's gradient lost, added next step
            self.q_memory[key] = q  # the next step starts from it (warm start)
            grad.copy_(mean.view(grad.shape))

    def with_error(self, parameter: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """GRAD as a matrix (rows: the first dimension), a copy, plus the error it carries."""
        matrix = grad.reshape(grad.shape[0], -1).to(torch.float32, copy=True)
        error = self.errors.get(self.keys[id(parameter)])
        return matrix if error is None else matrix.add_(error)

    def q_for(self, key: int, matrix: torch.Tensor) -> torch.Tensor:
        """The Q of the last step, or a random orthonormal one drawn from (seed, key) alone:
        the same on every rank, and after a resume."""
        if key not in self.q_memory:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
            q = torch.randn(matrix.shape[1], self.rank, generator=generator)
            self.q_memory[key] = orthogonalized(q.to(matrix.device))
        return self.q_memory[key]

    # --- the checkpoint: each rank's own state, gathered to rank 0, which writes it
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "errors": {key: tensor.cpu() for key, tensor in self.errors.items()},
            "q_memory": {key: tensor.cpu() for key, tensor in self.q_memory.items()},
        }

    def checkpoint_state(self, ctx: DistContext) -> dict[str, Any] | None:
        """Every rank's state, by rank, on rank 0 (None elsewhere). Collective."""
        states: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
        if ctx.distributed:
            dist.gather_object(self.state_dict(), states, dst=0)
        elif states is not None:
            states[0] = self.state_dict()
        if states is None:
            return None
        return {"method": self.name, "world_size": ctx.world_size, "ranks": states}

    def resume(self, saved: Any, run_step: int, ctx: DistContext) -> str | None:
        """This rank's own state from SAVED (a checkpoint's `grad_compression`); where it
        cannot be, a fresh state at RUN_STEP and the line that says why."""
        reason = unusable_reason(saved, self.name, ctx.world_size)
        if reason is None:
            own = saved["ranks"][ctx.rank]
            self.step = int(own["step"])
            self.errors = moved(own["errors"], ctx.device)
            self.q_memory = moved(own["q_memory"], ctx.device)
            return None
        self.step, self.errors, self.q_memory = run_step, {}, {}
        return (
            f"{self.name}: error feedback and Q memories start afresh at step {run_step}: {reason}"
        )


def unusable_reason(saved: Any, name: str, world_size: int) -> str | None:
    if not isinstance(saved, dict) or not saved.get("ranks"):
        return "the checkpoint holds none (it was trained without PowerSGD)"
    if saved.get("method") != name:
        return f"the checkpoint's are {saved.get('method')}'s"
    if saved.get("world_size") != world_size or len(saved["ranks"]) != world_size:
        return (
            f"they are each rank's own, and the world changed from {saved.get('world_size')} "
            f"to {world_size} ranks"
        )
    return None


def moved(tensors: dict[Any, torch.Tensor], device: torch.device) -> dict[int, torch.Tensor]:
    return {int(key): tensor.to(device) for key, tensor in tensors.items()}


def compressible(shape: torch.Size | tuple[int, ...], rank: int) -> bool:
    """A gradient PowerSGD sends as factors: a matrix (after folding all but the first
    dimension) whose rank-RANK factors are under half its size, as torch decides."""
    if len(shape) < 2:
        return False
    rows = shape[0]
    columns = 1
    for size in shape[1:]:
        columns *= size
    return rows * columns > (rows + columns) * rank * MIN_COMPRESSION_RATE


def all_reduce_now(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """TENSORS summed over the ranks in one all-reduce, waited for here (views of it)."""
    if not tensors:
        return []
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    dist.all_reduce(flat)
    pieces = flat.split([tensor.numel() for tensor in tensors])
    return [piece.view(tensor.shape) for piece, tensor in zip(pieces, tensors, strict=True)]


def orthogonalized(matrix: torch.Tensor) -> torch.Tensor:
    """MATRIX's columns made orthonormal in place (Gram-Schmidt, as torch's PowerSGD)."""
    columns = matrix.shape[1]
    for index in range(columns):
        column = matrix[:, index : index + 1]
        column /= column.norm() + ORTHOGONALIZATION_EPSILON
        if index + 1 < columns:
            rest = matrix[:, index + 1 :]
            rest -= (column * rest).sum(dim=0, keepdim=True) * column
    return matrix


def completed(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already holding BUFFER; on a GPU it carries the stream's order to DDP."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buffer.device] if buffer.is_cuda else None
    )
    future.set_result(buffer)
    return future


# --- what a step sends, for the run's header ----------------------------------------------


def bytes_per_step(parameters: Sequence[torch.Tensor], grad_compression: str) -> int:
    """Bytes all-reduced per optimizer step: every gradient as is (none), at half width
    (fp16, bf16), or PowerSGD's factors of each compressible matrix and the rest as is."""
    rank = powersgd_rank(grad_compression)
    total = 0
    for parameter in parameters:
        size = parameter.numel() * parameter.element_size()
        if grad_compression in HALF_HOOKS:
            total += parameter.numel() * 2
        elif rank is not None and compressible(parameter.shape, rank):
            rows = parameter.shape[0]
            total += (rows + parameter.numel() // rows) * rank * 4
        else:
            total += size
    return total


def describe_gradients(cfg: RunPlan, model: nn.Module, world_size: int) -> str:
    """`gradients: powersgd rank 2 after 1000 uncompressed steps: about 0.3 MB all-reduced
    per step instead of 44.7 MB ... · DDP buckets of 25 MB, ...`."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    full = shown_size(bytes_per_step(parameters, "none"))
    if world_size == 1:
        return (
            "gradients: one process, nothing all-reduced (--grad-compression "
            f"{cfg.grad_compression} has no effect)"
        )
    sent = shown_size(bytes_per_step(parameters, cfg.grad_compression))
    rank = powersgd_rank(cfg.grad_compression)
    if rank is not None:
        what = (
            f"powersgd rank {rank} after {cfg.powersgd_start_step} uncompressed steps: about "
            f"{sent} all-reduced per step instead of {full}; each rank's error "
            "feedback is checkpointed"
        )
    elif cfg.grad_compression in HALF_HOOKS:
        what = (
            f"{cfg.grad_compression} (torch's {cfg.grad_compression}_compress_hook): "
            f"{sent} all-reduced per step instead of {full}"
        )
    else:
        what = f"uncompressed, {full} all-reduced per step"
    return f"gradients: {what} · {describe_ddp_settings(cfg)}"


def shown_size(size: int) -> str:
    """44.7 MB, 0.3 MB; 2.0 kB for a model too small for a tenth of a megabyte."""
    return f"{size / MB:.1f} MB" if size >= MB / 10 else f"{size / 1e3:.1f} kB"


def describe_ddp_settings(cfg: RunPlan) -> str:
    return (
        f"DDP buckets of {cfg.bucket_cap_mb:g} MB, static graph "
        f"{'on' if cfg.static_graph else 'off'}, gradient as bucket view "
        f"{'on' if cfg.gradient_as_bucket_view else 'off'}"
    )


def start_step_warning(cfg: RunPlan, total_steps: int) -> str:
    """PowerSGD that never starts in this run deserves a word."""
    if powersgd_rank(cfg.grad_compression) is None or cfg.powersgd_start_step < total_steps:
        return ""
    return (
        f"--powersgd-start-step {cfg.powersgd_start_step}: this run has {total_steps} steps, "
        "so none is compressed; lower it (torch suggests about a tenth of the steps)"
    )
