"""Process group set-up, device choice and the collectives the engine uses.

The whole DDP contract in one place, nanoGPT style: read our rank from the launcher,
bind the device *before* any CUDA work, init the group with a timeout, tear it down.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import itertools
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddpcli import ui
from ddpcli.environments import LauncherEnv
from ddpcli.environments.world import DEFAULT_MASTER_PORT, tcp_address
from ddpcli.errors import STOPPED_FOR_PEER, first_line, runtime_error, usage_error
from ddpcli.fork_guard import fork_only_when_quiet
from ddpcli.interrupts import ctrl_c_ends_a_stuck_wait


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def choose_device(local_rank: int, want_gpu: bool) -> torch.device:
    """One process per GPU: local rank r drives cuda:r of the GPUs this process can see; a
    process that sees exactly one GPU drives that one, whatever its local rank (SLURM's
    `--gpus-per-task=1`, where SLURM_LOCALID still counts 0..k on the node)."""
    if not want_gpu or not torch.cuda.is_available():
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if local_rank >= visible > 1:
        raise usage_error(
            f"local rank {local_rank} has no GPU: this process sees {visible} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )
    device = torch.device("cuda", local_rank if visible > 1 else 0)
    # Must happen before any CUDA work, or every rank allocates a context on GPU 0.
    torch.cuda.set_device(device)
    return device


def choose_backend(requested: str, device: torch.device) -> str:
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise usage_error("--backend nccl needs GPUs; use --backend gloo (or auto) on the CPU")
    return requested


def init_distributed(
    env: LauncherEnv,
    *,
    want_gpu: bool,
    backend: str,
    init_method: str | None,
    timeout_s: float,
    group_of_one: bool = False,
) -> DistContext:
    """Join the job's process group. A world of one forms none (training needs no collective
    there) unless it names its own rendezvous or asks for `group_of_one`: the instruments
    (bench-barrier, check-env --probe) time and check the group's collectives even alone."""
    device = choose_device(env.local_rank, want_gpu)
    backend = choose_backend(backend, device)
    if init_method == "env://":
        init_method = None  # the default spelled out: keep its per-restart store below
    if init_method is None and env.launcher == "slurm":
        # srun sets no MASTER_ADDR/PORT; the address comes from SLURM_NODELIST.
        init_method = f"tcp://{env.master_addr}:{env.master_port or DEFAULT_MASTER_PORT}"
    if env.world_size > 1 or init_method or group_of_one:
        fork_only_when_quiet()  # the group's threads would hang a forked loader worker
        # TORCH_NCCL_ASYNC_ERROR_HANDLING stays as the launcher left it. Either way a timed-out
        # collective ends the rank: torch's default (3) ends it without ncclCommAbort, which
        # can itself hang; 1 (what torchrun's agent sets) aborts first. Nothing measured
        # argues for overriding torch (see docs/multi-node.md).
        try:
            # A peer that the same Ctrl-C ended never comes. Started by hand, a rank says so.
            with ctrl_c_ends_a_stuck_wait(said=env.launcher == "env"):
                dist.init_process_group(
                    backend=backend,
                    **rendezvous_args(env, init_method, timeout_s),
                    rank=env.rank,
                    world_size=env.world_size,
                    timeout=datetime.timedelta(seconds=timeout_s),
                    # Binding the device lets barriers and NCCL know it instead of guessing.
                    device_id=device if device.type == "cuda" else None,
                )
        except (RuntimeError, ValueError) as error:
            raise runtime_error(
                f"rank {env.rank}: could not join the process group ({backend}, "
                f"{init_method or 'env://'}) within {timeout_s:g}s: {first_line(error)}"
            ) from error
    return DistContext(
        rank=env.rank,
        local_rank=env.local_rank,
        world_size=env.world_size,
        local_world_size=env.local_world_size,
        node_rank=env.node_rank,
        device=device,
        backend=backend,
    )


def rendezvous_args(env: LauncherEnv, init_method: str | None, timeout_s: float) -> dict[str, Any]:
    """Where the ranks meet. A store that outlives the workers (the agent's, a file:// file)
    still holds the dead ranks' addresses after a restart (--max-restarts): restarted Gloo
    ranks read them and fail to connect. Each attempt then gets its own key prefix."""
    if init_method is None and env.agent_store:
        return {"store": attempt_store(env, timeout_s)}
    if init_method and init_method.startswith("tcp://") and env.agent_store:
        return {"store": tcp_store(init_method, env, timeout_s)}
    if init_method and init_method.startswith("file://") and env.restart_count > 0:
        store = dist.FileStore(init_method.removeprefix("file://"), env.world_size)
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        return {"store": dist.PrefixStore(f"ddpcli/attempt-{env.restart_count}", store)}
    return {"init_method": init_method or "env://"}


def tcp_store(init_method: str, env: LauncherEnv, timeout_s: float) -> dist.Store:
    """--init-method tcp://HOST:PORT under the elastic agent: rank 0 serves the store there
    and the others dial it, as torch 2.14 has it. torch 2.11 read the agent's
    TORCHELASTIC_USE_AGENT_STORE as true of any address, so every rank dialled a store that
    nobody served, until the timeout. The agent's own address is the agent's store."""
    host, port = tcp_address(init_method)
    if host == env.master_addr and port == env.master_port:
        return attempt_store(env, timeout_s)
    return dist.TCPStore(
        host,
        port,
        world_size=env.world_size,
        is_master=env.rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        multi_tenant=True,
    )


def attempt_store(env: LauncherEnv, timeout_s: float) -> dist.Store:
    """The elastic agent's store, under a prefix per restart. With plain env:// the agent
    reuses one store across restarts, and restarted Gloo ranks can read the dead ranks'
    addresses and fail to connect (seen on torch 2.14 with --max-restarts)."""
    if env.master_addr is None or env.master_port is None:
        raise usage_error(
            f"rank {env.rank}: TORCHELASTIC_USE_AGENT_STORE is set but MASTER_ADDR and "
            "MASTER_PORT, where the agent's store listens, are not"
        )
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        world_size=env.world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.PrefixStore(f"ddpcli/attempt-{env.restart_count}", store)


def shutdown() -> None:
    """Every worker ends here: without it a Gloo worker can abort at interpreter exit."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


@contextlib.contextmanager
def zero_first(ctx: DistContext) -> Iterator[None]:
    """Rank 0 runs the block first (download, cache) while the others wait, then they run it."""
    if not ctx.is_main:
        barrier(ctx)
    yield
    if ctx.is_main:
        barrier(ctx)


PREPARE_TIMEOUT_S = 6 * 3600.0  # a download from a slow mirror, a one-time decode of ImageNet
_preparations = itertools.count()  # every rank prepares the same things in the same order


@contextlib.contextmanager
def rank_zero_prepares(
    ctx: DistContext, what: str, timeout_s: float = PREPARE_TIMEOUT_S
) -> Iterator[None]:
    """zero_first for work that may take far longer than --timeout (a download, a decode):
    the other ranks wait on the store, not in a collective that --timeout bounds (and that
    under NCCL would kill the job), up to `timeout_s`, and they say what they wait for."""
    if not ctx.distributed:
        yield
        return
    store = dist.distributed_c10d._get_default_store()
    key = f"ddpcli/prepared/{next(_preparations)}"
    if not ctx.is_main:
        wait_for_rank_zero(store, key, ctx, what, timeout_s)
        yield
        return
    try:
        yield
    except Exception:
        release_waiting_ranks(store, key, ctx)
        raise
    store.set(key, PREPARED)


PREPARED, PREPARATION_FAILED = "done", "failed"
# How long a rank 0 that failed to prepare waits, at most, for the others to answer.
RELEASE_S = 10.0
# How long a rank released so waits, at most, for rank 0 to leave and the agent to stop it.
RANK_ZERO_LEAVES_S = 30.0


def release_waiting_ranks(store: dist.Store, key: str, ctx: DistContext) -> None:
    """Rank 0 failed to prepare and will say why: the ranks waiting for it answer that they
    will go quietly (`leave_with_rank_zero`) before it leaves. Left waiting, the agent's
    SIGTERM after rank 0's exit made each of them print its stack, though none was stuck."""
    answered = [f"{key}/answered/{rank}" for rank in range(1, ctx.world_size)]
    with contextlib.suppress(RuntimeError, dist.DistError):  # a store gone: say it anyway
        store.set(key, PREPARATION_FAILED)
        store.wait(answered, datetime.timedelta(seconds=RELEASE_S))


def wait_for_rank_zero(
    store: dist.Store, key: str, ctx: DistContext, what: str, timeout_s: float
) -> None:
    if ctx.local_rank == 1:  # one line per node is enough
        ui.info(f"rank {ctx.rank} waits for rank 0 to {what} (up to {timeout_s / 3600:g} h)")
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
        failed = store.get(key).decode() == PREPARATION_FAILED
    except (RuntimeError, dist.DistError) as error:
        raise runtime_error(
            f"rank {ctx.rank}: rank 0 did not {what} within {timeout_s:g}s ({first_line(error)})"
        ) from error
    if failed:
        leave_with_rank_zero(store, key, ctx, what)


def leave_with_rank_zero(store: dist.Store, key: str, ctx: DistContext, what: str) -> NoReturn:
    """Rank 0 failed to prepare and says why itself; this rank's failure is a consequence
    (ddpcli.training.worker ends it quietly). No stack on the agent's SIGTERM from here on: rank 0
    leaves once every waiting rank has answered, and the agent then stops them all."""
    faulthandler.unregister(signal.SIGTERM)
    with contextlib.suppress(RuntimeError, dist.DistError):
        store.set(f"{key}/answered/{ctx.rank}", "")
    # Rank 0 leaves first. An agent that saw this rank leave first would stop rank 0 before
    # it said why (and the job's exit status with it). The agent's SIGTERM ends this wait.
    time.sleep(RANK_ZERO_LEAVES_S)
    raise RuntimeError(f"{STOPPED_FOR_PEER}: rank 0 failed to {what}")


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum over ranks, in place; every rank gets the exact global total."""
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


@torch.no_grad()
def broadcast_from_rank0(tensors: list[torch.Tensor], ctx: DistContext) -> None:
    """TENSORS set to rank 0's, in place: one broadcast per dtype and device, not one per
    tensor (a model's buffers are many and small)."""
    if not ctx.distributed:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group in groups.values():
        flat = _flatten_dense_tensors(group)
        dist.broadcast(flat, src=0)
        for tensor, synced in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
            tensor.copy_(synced)


Value = TypeVar("Value")


def broadcast_object(value: Value, ctx: DistContext, src: int = 0) -> Value:
    if not ctx.distributed:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_object(value: Value, ctx: DistContext) -> list[Value]:
    """Every rank's `value` (picklable), in rank order, on every rank."""
    if not ctx.distributed:
        return [value]
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, value)
    return gathered
