"""The data pipeline of torchvision's reference classification recipe
(github.com/pytorch/vision, references/classification: train.py and presets.py).

    torchrun --standalone --nproc-per-node 1 benchmarks/peers/reference_pipeline.py \
        --data-dir FOLDER --workers 8 --steps 50

As the recipe does it by default: ImageFolder decoding each JPEG with PIL in DataLoader
workers; RandomResizedCrop, RandomHorizontalFlip, PILToTensor, ConvertImageDtype and
Normalize per image (ClassificationPresetTrain, PIL backend, no auto-augment);
DistributedSampler; pin_memory; workers restarted every epoch; loss and accuracy read with
.item() every step (the recipe's MetricLogger); no channels_last. The model, image size,
batch and autocast precision are the benchmark's, the same as ddpcli's.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from _common import Throughput
from _speed_common import autocast, build_model, finish, init, parse_args
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def reference_loader(
    train_dir: Path, image_size: int, batch: int, workers: int, world_size: int, rank: int
) -> DataLoader:
    """The recipe's training DataLoader (also timed alone by the benchmark)."""
    import torchvision
    from torchvision import transforms as T

    preset = T.Compose([
        T.RandomResizedCrop(image_size, interpolation=T.InterpolationMode.BILINEAR),
        T.RandomHorizontalFlip(0.5),
        T.PILToTensor(),
        T.ConvertImageDtype(torch.float),
        T.Normalize(mean=MEAN, std=STD),
    ])  # fmt: skip
    dataset = torchvision.datasets.ImageFolder(str(train_dir), preset)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    return DataLoader(
        dataset, batch_size=batch, sampler=sampler, num_workers=workers, pin_memory=True
    )


def add_arguments(parser) -> None:
    parser.add_argument("--data-dir", type=Path, required=True, help="holds train/<class>/*")
    parser.add_argument("--workers", type=int, default=8, help="DataLoader workers per rank")


def main() -> None:
    args = parse_args(__doc__, add_arguments)
    rank, world_size, device = init(args.cpu)
    model = build_model(args.arch, device)
    model = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    loader = reference_loader(
        args.data_dir / "train", args.image_size, args.batch, args.workers, world_size, rank
    )
    clock = Throughput(args.warmup, device)
    model.train()
    epoch = 0
    while clock.steps < args.total_steps:
        loader.sampler.set_epoch(epoch)
        for image, target in loader:
            image, target = image.to(device), target.to(device)
            with autocast(args.precision, device):
                output = model(image)
                loss = F.cross_entropy(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            # MetricLogger: every step reads the loss and top-1 back to the host.
            _ = loss.item(), (output.argmax(1) == target).float().mean().item()
            clock.step(len(image))
            if clock.steps == args.total_steps:
                break
        epoch += 1
    finish(args, "reference_pipeline", clock, device)


if __name__ == "__main__":
    main()
