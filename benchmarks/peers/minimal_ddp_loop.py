"""The least a DDP training loop can do: the "speed of light" ddpcli is measured against.

    torchrun --standalone --nproc-per-node 1 benchmarks/peers/minimal_ddp_loop.py --steps 50

Random uint8 images already on the device, a random crop (padding 4, one offset per
batch) and a per-sample flip on the device, normalisation, channels_last on GPUs,
autocast, DDP, SGD with momentum (fused on GPUs). No validation, no logging, no
checkpoints, no host synchronisation between the timing window's edges.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _common import Throughput
from _speed_common import autocast, build_model, finish, init, parse_args
from torch.nn.parallel import DistributedDataParallel

PAD = 4


def main() -> None:
    args = parse_args(__doc__, compile_option)
    rank, world_size, device = init(args.cpu)
    on_gpu = device.type == "cuda"
    model = build_model(args.arch, device)
    if on_gpu:
        model = model.to(memory_format=torch.channels_last)
    model = DistributedDataParallel(model, device_ids=[device.index] if on_gpu else None)
    forward = torch.compile(model, mode=args.compile) if args.compile else model
    fast = {"fused": True} if on_gpu else {"foreach": True}
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, **fast)

    generator = torch.Generator(device=device).manual_seed(args.seed + rank)
    offsets = torch.randint(0, 2 * PAD + 1, (args.total_steps, 2)).tolist()  # host: no sync
    size, count = args.image_size, args.batch * args.total_steps
    images = torch.randint(0, 256, (count, 3, size, size), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (count,), device=device)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1)
    memory_format = torch.channels_last if on_gpu else torch.contiguous_format

    clock = Throughput(args.warmup, device)
    for step in range(args.total_steps):
        batch = slice(step * args.batch, (step + 1) * args.batch)
        x = F.pad(images[batch], (PAD, PAD, PAD, PAD))
        top, left = offsets[step]
        x = x[:, :, top : top + size, left : left + size]
        flip = torch.rand(len(x), 1, 1, 1, generator=generator, device=device) < 0.5
        x = torch.where(flip, x.flip(3), x)
        x = ((x.float() / 255 - mean) / std).contiguous(memory_format=memory_format)
        with autocast(args.precision, device):
            loss = F.cross_entropy(forward(x), labels[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.step(len(x))
    finish(args, "minimal_ddp_loop", clock, device)


def compile_option(parser) -> None:
    # What CUDA graphs would give a launch-bound step: `--compile reduce-overhead`.
    parser.add_argument("--compile", metavar="MODE", help="torch.compile's mode (default: eager)")


if __name__ == "__main__":
    main()
