"""What the gpu_throughput peers share (benchmarks/gpu_throughput.py runs them).

Each peer is one rank under torchrun: it binds the GPU of its LOCAL_RANK (or runs on the
CPU with Gloo), times its optimizer steps after the first `--warmup` like ddpcli's
StepTimer (device synchronised at the window's edges only), and rank 0 writes one JSON
result: images/s summed over ranks, when its first step finished, peak memory per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _common import Throughput

# The benchmark runs from any folder; the model registry is ddpcli's, so every contender
# builds exactly the same network (torchvision names and the small built-in ones).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse_args(description: str, extra=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=128, help="per-process batch")
    parser.add_argument("--steps", type=int, default=50, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--cpu", action="store_true", help="Gloo on the CPU")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result", type=Path, help="rank 0 writes its figures here (JSON)")
    if extra:
        extra(parser)
    args = parser.parse_args()
    args.total_steps = args.warmup + args.steps
    return args


def init(cpu: bool) -> tuple[int, int, torch.device]:
    """Rank, world size and this rank's device; the device is bound before any CUDA work."""
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cpu or not torch.cuda.is_available():
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size(), device


def build_model(arch: str, device: torch.device) -> torch.nn.Module:
    from ddpcli.models.build import build_model as registry_model

    torch.manual_seed(0)
    return registry_model(arch, num_classes=10).to(device)


def autocast(precision: str, device: torch.device):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def per_rank(value: float, device: torch.device) -> list[float]:
    values = torch.zeros(dist.get_world_size(), device=device, dtype=torch.float64)
    values[dist.get_rank()] = value
    dist.all_reduce(values)
    return [round(v, 1) for v in values.tolist()]


def finish(args: argparse.Namespace, name: str, clock: Throughput, device: torch.device) -> None:
    """Reduce the figures, write rank 0's result, leave the group."""
    rate = clock.images_per_sec()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    figures = {
        "contender": name,
        "images_per_sec": rate,
        "first_step_at": clock.first_step_at,
        "world_size": dist.get_world_size(),
        "peak_rss_mb": per_rank(rss_mb, device),
    }
    if device.type == "cuda":
        figures["peak_memory_mb"] = per_rank(
            torch.cuda.max_memory_allocated(device) / 2**20, device
        )
    if dist.get_rank() == 0:
        print(f"{name}: {rate:.1f} img/s", flush=True)
        if args.result:
            args.result.write_text(json.dumps(figures) + "\n")
    dist.destroy_process_group()
