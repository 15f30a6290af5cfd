"""HF Accelerate on the CPU, launched by torchrun.

    torchrun --standalone --nproc-per-node 2 benchmarks/peers/accelerate_loop.py --steps 60

`Accelerator(cpu=True)` sees torchrun's variables, joins a Gloo group (MULTI_CPU) and
`prepare` wraps the model in DDP and shards the DataLoader. The loop is the one from
Accelerate's examples: forward, `accelerator.backward`, step, zero_grad.
"""

from __future__ import annotations

import torch
import torchvision
from _common import (
    AugmentCollate,
    Throughput,
    apply_thread_count,
    in_memory_images,
    parse_args,
    write_result,
)
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    args = parse_args(__doc__)
    threads = apply_thread_count()
    # Accelerate's own default (no mixed precision) unless bf16 is asked for.
    mixed = {"mixed_precision": "bf16"} if args.precision == "bf16" else {}
    accelerator = Accelerator(cpu=True, **mixed)
    set_seed(args.seed)
    model = torchvision.models.get_model(args.arch, weights=None, num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=5e-4)
    dataset = TensorDataset(*in_memory_images(accelerator.num_processes, args))
    loader = DataLoader(
        dataset,
        batch_size=args.batch,
        shuffle=True,
        num_workers=0,
        collate_fn=AugmentCollate(args.seed + accelerator.process_index),
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    criterion = nn.CrossEntropyLoss()

    meter = Throughput(args.warmup)
    model.train()
    loss_sum = correct = seen = 0.0
    for step, (images, target) in enumerate(loader, start=1):
        output = model(images)
        loss = criterion(output, target)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        loss_sum += loss.item() * len(target)
        correct += (output.argmax(1) == target).sum().item()
        seen += len(target)
        meter.step(len(target))
        if step == args.total_steps:
            break

    rate = meter.images_per_sec()
    if accelerator.is_main_process:
        print(f"accelerate: {rate:.1f} img/s, loss {loss_sum / seen:.3f}, acc {correct / seen:.3f}")
    write_result(args.result, "accelerate", rate, args.steps, threads)
    accelerator.end_training()


if __name__ == "__main__":
    main()
