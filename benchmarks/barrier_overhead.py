"""Does `ddpcli bench-barrier` measure barrier(), or itself?

Times barriers two ways in the same processes, in alternating rounds so that load on the
machine hits both alike:
  - bare: a loop of dist.barrier() calls, each timed with time.perf_counter();
  - ddpcli: ddpcli.timing.time_calls_ns(), the loop behind `--iters`.
and prints the p50 (and p90, mean) of each, and their ratio. With --cli it also runs
`ddpcli bench-barrier --demo none --json` with the same rank count and prints its p50.

    python benchmarks/barrier_overhead.py [--nproc 2] [--iters 2000] [--rounds 5] [--cli]
    python benchmarks/barrier_overhead.py --backend nccl --nproc 2   # on a GPU machine

Figures only; nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddpcli.timing import time_calls_ns


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def bare_loop(barrier_once, count: int) -> list[float]:
    """What a user would write: perf_counter around each barrier() call."""
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        barrier_once()
        samples.append(time.perf_counter() - started)
    return samples


def barrier_for(backend: str, rank: int):
    if backend != "nccl":
        return dist.barrier
    device = torch.device("cuda", rank)

    def barrier_on_device() -> None:
        dist.barrier()
        torch.cuda.synchronize(device)

    return barrier_on_device


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        args.backend, rank=rank, world_size=args.nproc, timeout=datetime.timedelta(seconds=120)
    )
    barrier_once = barrier_for(args.backend, rank)
    bare_loop(barrier_once, args.warmup)
    measured: dict[str, list[float]] = {"bare": [], "ddpcli": []}
    for round_index in range(args.rounds):
        # Alternate which goes first, so neither always runs on a warmer (or busier) machine.
        order = ("bare", "ddpcli") if round_index % 2 == 0 else ("ddpcli", "bare")
        for method in order:
            if method == "bare":
                measured["bare"] += [s * 1e6 for s in bare_loop(barrier_once, args.iters)]
            else:
                measured["ddpcli"] += [ns / 1e3 for ns in time_calls_ns(barrier_once, args.iters)]
    everyone = [None] * args.nproc if rank == 0 else None
    dist.gather_object(measured, everyone, dst=0)
    if rank == 0:
        print_figures(args, everyone)
    dist.destroy_process_group()


def print_figures(args: argparse.Namespace, everyone: list[dict]) -> None:
    print(
        f"setting: {args.nproc} ranks, {args.backend}, {args.iters} barriers x "
        f"{args.rounds} rounds per method per rank, {args.warmup} warm-up"
    )
    print(f"{'method':<34}{'p50 µs':>10}{'p90 µs':>10}{'mean µs':>10}")
    p50 = {}
    for method, label in (
        ("bare", "bare loop, time.perf_counter()"),
        ("ddpcli", "ddpcli.timing.time_calls_ns()"),
    ):
        samples = np.concatenate([ranks[method] for ranks in everyone])
        p50[method], p90 = np.percentile(samples, [50, 90])
        print(f"{label:<34}{p50[method]:>10.1f}{p90:>10.1f}{samples.mean():>10.1f}")
    ratio = p50["ddpcli"] / p50["bare"]
    print(f"ddpcli p50 / bare p50: {ratio:.3f} ({100 * (ratio - 1):+.1f} %)")


def cli_p50(args: argparse.Namespace) -> None:
    """The whole command, end to end, in processes of its own."""
    placement = ["--nproc", str(args.nproc)]
    if args.backend == "nccl":
        placement = ["--gpus", ",".join(str(index) for index in range(args.nproc))]
    command = [sys.executable, "-m", "ddpcli", "bench-barrier", *placement, "--demo", "none"]
    command += ["--iters", str(args.iters * args.rounds), "--warmup", str(args.warmup), "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        print(f"ddpcli bench-barrier failed:\n{result.stderr}")
        return
    latency = json.loads(result.stdout)["latency_us"]
    print(
        f"{'ddpcli bench-barrier (own run)':<34}{latency['p50']:>10.1f}{latency['p90']:>10.1f}"
        f"{'':>10}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--cli", action="store_true", help="also run the ddpcli command")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(rank_main, args=(args, free_port()), nprocs=args.nproc, join=True)
    if args.cli:
        cli_p50(args)


if __name__ == "__main__":
    main()
