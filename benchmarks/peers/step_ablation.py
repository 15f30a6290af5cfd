"""Which per-step choices make a CPU DDP step faster? An A/B of them in the same processes.

    python benchmarks/peers/step_ablation.py                    # resnet18, 96 px, batch 16
    python benchmarks/peers/step_ablation.py --rounds 10 --variants peer,ddpcli,fused,fused+cl

Two Gloo ranks (mp.spawn, one thread each unless --threads) build one DDP model per
variant, then run the variants in turn, a block of --block steps each, for --rounds
rounds: a change in the machine's load hits every variant alike. Printed per variant: the
median and lower quartile of the step time (forward, backward with the gradient
all-reduce, optimizer step, zero_grad) and the process CPU time per step. Then the
optimizer step alone, per implementation, on one rank.

Variants are '+'-joined tokens:
  peer      DDP defaults, SGD(momentum, weight_decay) with torch's default implementation
  ddpcli    what ddpcli.training.parts builds: gradient_as_bucket_view, nesterov, decay on weights
            only, foreach=True
  fused     as ddpcli, with fused=True
  cl        channels_last model and input
  gabv      gradient_as_bucket_view (with `peer`)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--variants", default="peer,ddpcli,fused,fused+cl")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) // 2))
    parser.add_argument("--port", type=int, default=29631)
    return parser.parse_args()


def param_groups(model: nn.Module, split: bool) -> list[dict]:
    if not split:
        return [{"params": list(model.parameters()), "weight_decay": 5e-4}]
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return [{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, tokens: set[str]) -> torch.optim.Optimizer:
    if "fused" in tokens:
        return torch.optim.SGD(param_groups(model, True), lr=0.1, momentum=0.9, nesterov=True,
                               fused=True)  # fmt: skip
    if "ddpcli" in tokens:
        return torch.optim.SGD(param_groups(model, True), lr=0.1, momentum=0.9, nesterov=True,
                               foreach=True)  # fmt: skip
    return torch.optim.SGD(param_groups(model, False), lr=0.1, momentum=0.9)


def build_variant(name: str, args: argparse.Namespace):
    tokens = set(name.split("+"))
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.arch, weights=None, num_classes=10)
    if "cl" in tokens:
        model = model.to(memory_format=torch.channels_last)
    bucket_view = bool(tokens & {"ddpcli", "fused", "gabv"})
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    return ddp, build_optimizer(model, tokens), "cl" in tokens


def worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    names = args.variants.split(",")
    built = {name: build_variant(name, args) for name in names}
    criterion = nn.CrossEntropyLoss()
    images = torch.randn(args.batch, 3, args.image_size, args.image_size)
    labels = torch.randint(0, 10, (args.batch,))
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds + 1):  # round 0 warms every variant up
        for name in names:
            model, optimizer, channels_last = built[name]
            batch = (
                images.contiguous(memory_format=torch.channels_last) if channels_last else images
            )
            dist.barrier()
            for _ in range(args.block):
                start, start_cpu = time.perf_counter(), time.process_time()
                criterion(model(batch), labels).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if round_:
                    wall[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
    if rank == 0:
        report_steps(names, wall, cpu, args)
        report_optimizers(args)
    dist.destroy_process_group()


def report_steps(names, wall, cpu, args) -> None:
    print(
        f"{args.arch}, {args.image_size} px, batch {args.batch} per rank, 2 Gloo ranks x "
        f"{args.threads} thread(s); {args.rounds} rounds of {args.block} steps per variant"
    )
    print(f"{'variant':<16}{'median ms':>11}{'q25 ms':>9}{'img/s at median':>17}{'cpu ms':>9}")
    for name in names:
        times = sorted(wall[name])
        median, q25 = statistics.median(times), times[len(times) // 4]
        rate = 2 * args.batch / median
        cpu_ms = 1e3 * statistics.median(cpu[name])
        print(f"{name:<16}{1e3 * median:>11.1f}{1e3 * q25:>9.1f}{rate:>17.1f}{cpu_ms:>9.1f}")


def report_optimizers(args) -> None:
    """The optimizer step alone: resnet18 has 11.7 M parameters, so it is not free."""
    model = torchvision.models.get_model(args.arch, weights=None, num_classes=10)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter) * 1e-3
    configs = {
        "momentum, default (peers)": dict(momentum=0.9),
        "nesterov, foreach (ddpcli)": dict(momentum=0.9, nesterov=True, foreach=True),
        "nesterov, default": dict(momentum=0.9, nesterov=True),
        "momentum, foreach": dict(momentum=0.9, foreach=True),
        "nesterov, fused": dict(momentum=0.9, nesterov=True, fused=True),
    }
    optimizers = {
        name: torch.optim.SGD(param_groups(model, True), lr=0.1, **kwargs)
        for name, kwargs in configs.items()
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    for round_ in range(12):
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            if round_ >= 2:
                times[name].append(time.perf_counter() - start)
    print("\noptimizer.step() alone, one rank:")
    for name, values in times.items():
        print(f"  {name:<28}{1e3 * statistics.median(values):7.1f} ms")


def main() -> None:
    args = parse_args()
    mp.spawn(worker, args=(args,), nprocs=2)


if __name__ == "__main__":
    main()
