"""The hand-written DDP loop, pytorch/examples (imagenet/main.py) style.

    torchrun --standalone --nproc-per-node 2 benchmarks/peers/ddp_loop.py --steps 60

DistributedSampler + DataLoader over a TensorDataset, DDP on the CPU with Gloo, SGD with
momentum and weight decay, loss and top-1 accuracy read every step as the example's
meters do. `--precision bf16`: forward and loss under torch.autocast("cpu", torch.bfloat16),
as PyTorch's AMP documentation writes it for the CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torchvision
from _common import (
    AugmentCollate,
    Throughput,
    apply_thread_count,
    in_memory_images,
    parse_args,
    write_result,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    args = parse_args(__doc__)
    threads = apply_thread_count()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)
    model = torchvision.models.get_model(args.arch, weights=None, num_classes=10)
    model = DistributedDataParallel(model)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=5e-4)

    dataset = TensorDataset(*in_memory_images(world_size, args))
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(
        dataset,
        batch_size=args.batch,
        sampler=sampler,
        num_workers=0,
        collate_fn=AugmentCollate(args.seed + rank),
    )

    meter = Throughput(args.warmup)
    sampler.set_epoch(0)
    model.train()
    loss_sum = correct = seen = 0.0
    for step, (images, target) in enumerate(loader, start=1):
        with torch.autocast("cpu", torch.bfloat16, enabled=args.precision == "bf16"):
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_sum += loss.item() * len(target)
        correct += (output.argmax(1) == target).sum().item()
        seen += len(target)
        meter.step(len(target))
        if step == args.total_steps:
            break

    rate = meter.images_per_sec()
    if rank == 0:
        print(f"ddp_loop: {rate:.1f} img/s, loss {loss_sum / seen:.3f}, acc {correct / seen:.3f}")
    write_result(args.result, "ddp_loop", rate, args.steps, threads)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
