"""`ddpcli bench-barrier` from start to end: in each rank (`run_rank`) the demo and the
measurements; in the launching process (`run_bench`) the ranks started, rank 0's report
read, and a hang turned into a summary."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ddpcli import ui
from ddpcli.barrier import BARRIER_WORKER_MODULE
from ddpcli.barrier.demos import demo_summary, staggered_demo, zero_first_demo
from ddpcli.barrier.hang import BarrierHang, collect_hang
from ddpcli.barrier.measure import measure_collective, measure_latency
from ddpcli.barrier.rank import (
    BarrierTimeout,
    BenchRank,
    dump_stacks_on_sigterm,
    gather_to_rank0,
    group_timeout_s,
    join_bench,
)
from ddpcli.config import BarrierConfig
from ddpcli.dist import DistContext, init_distributed, shutdown
from ddpcli.environments import LauncherEnv, read_launcher_env
from ddpcli.errors import DdpcliError, usage_error
from ddpcli.launcher.engine import WorkerJob, run_workers, worker_environment
from ddpcli.launcher.fork import forks_workers
from ddpcli.launcher.resolve import check_torch_sees_gpus
from ddpcli.machine import check_gpu_indices, cpu_count

RESULT_FILE = "result.json"


def run_rank(cfg: BarrierConfig, env: LauncherEnv, workdir: Path | None) -> dict | None:
    """Everything a rank does; returns the report on rank 0, None elsewhere."""
    if cfg.world_size != env.world_size:
        raise usage_error(
            f"the launcher started {env.world_size} ranks but the flags describe "
            f"{cfg.world_size}; drop --nproc/--gpus or make them agree"
        )
    torch.set_num_threads(max(1, cpu_count() // max(1, env.local_world_size)))
    stacks = dump_stacks_on_sigterm(workdir, env.rank)
    ctx = init_distributed(
        env,
        want_gpu=cfg.uses_gpus,
        backend=cfg.backend,
        init_method=None,
        timeout_s=group_timeout_s(cfg),
        group_of_one=True,  # its barrier is what we time
    )
    hung = False
    try:
        bench = join_bench(ctx, env, cfg, workdir, stacks)
        report = run_phases(bench, cfg)
        if report is not None and workdir is not None:
            (workdir / RESULT_FILE).write_text(json.dumps(report, indent=2))
        return report
    except BarrierTimeout:
        hung = True  # tearing the group down would wait on the missing rank
        raise
    finally:
        if not hung:
            shutdown()


def run_phases(bench: BenchRank, cfg: BarrierConfig) -> dict | None:
    demos = {"staggered": staggered_demo, "zero-first": zero_first_demo}
    rows = gather_to_rank0(bench, demos[cfg.demo](bench, cfg)) if cfg.demo in demos else []
    latency = measure_latency(bench, cfg)  # None on every rank but 0, which gathers them
    collectives = [
        measure_collective(bench, cfg, name, size) for name in cfg.collective for size in cfg.sizes
    ]
    if not bench.ctx.is_main or latency is None:
        return None
    report = describe_setup(bench.ctx, cfg)
    report["ranks"] = rows
    if rows:
        report.update(demo_summary(cfg.demo, rows))
    report.update(latency)
    report["collectives"] = collectives
    return report


def describe_setup(ctx: DistContext, cfg: BarrierConfig) -> dict:
    if ctx.backend == "nccl":
        how = (
            "NCCL implements barrier() as an all_reduce of one element on the GPU; "
            "each one is timed until torch.cuda.synchronize() returns"
        )
    else:
        how = "Gloo barrier() over TCP on the CPU; the demo's barrier is monitored_barrier()"
    return {
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": f"cuda (GPUs {','.join(map(str, cfg.gpus))})" if cfg.gpus else "cpu",
        "barrier": how,
        "demo": cfg.demo,
        "timeout_s": cfg.timeout,
    }


# --- The launching process ---------------------------------------------------------------


def run_bench(
    cfg: BarrierConfig, debug: bool = False, on_start: Callable[[], None] | None = None
) -> dict | None:
    """Run the benchmark; rank 0's report (None on other ranks under an outside launcher).
    `on_start` runs once the checks have passed, just before the ranks start."""
    launcher = read_launcher_env()
    if launcher is not None:  # torchrun or SLURM made this process a rank
        return run_rank(cfg, launcher, workdir=None)
    check_gpu_indices(cfg.gpus, cpu_alternative="--nproc N for CPU ranks")
    check_torch_sees_gpus(len(cfg.gpus or []), on_the_cpu="use --nproc N for CPU ranks")
    if on_start is not None:
        on_start()
    workdir = Path(tempfile.mkdtemp(prefix="ddpcli-bench-barrier-"))
    try:
        return launch_ranks(cfg, workdir, debug)
    finally:
        if debug:
            ui.info(f"debug: what the ranks left behind is in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def launch_ranks(cfg: BarrierConfig, workdir: Path, debug: bool) -> dict:
    request = workdir / "config.json"
    request.write_text(cfg.model_dump_json())
    job = WorkerJob(
        module=BARRIER_WORKER_MODULE,
        args=[str(request), str(workdir)],
        nproc_per_node=cfg.world_size,
        fork=forks_workers(cfg.uses_gpus),
        timeout_s=group_timeout_s(cfg),
        env=worker_environment(cfg.gpus, cfg.world_size),
    )
    try:
        run_workers(job, debug)
    except DdpcliError:
        hang = collect_hang(workdir, cfg)
        if hang is None:
            raise
        raise BarrierHang(hang) from None
    return json.loads((workdir / RESULT_FILE).read_text())
