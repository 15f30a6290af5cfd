"""What the peer scripts share, so that only the framework differs between them.

The same in every peer (and in `ddpcli train`): a torchvision model with 10 classes,
uint8 images held in memory, a per-sample random crop (padding 4) and horizontal flip,
then float conversion and normalisation, cross-entropy, SGD with momentum 0.9.
Throughput is timed like ddpcli's StepTimer: each rank starts its clock after its
`--warmup`-th optimizer step and stops it after the last; images are summed over
ranks and divided by the slowest rank's time.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

CROP_PADDING = 4  # as ddpcli.data
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
NUM_CLASSES = 10


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=16, help="per-process batch")
    parser.add_argument("--steps", type=int, default=60, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    # Only Lightning takes it (it starts its ranks itself); torchrun sets the others' world.
    parser.add_argument("--devices", type=int, default=2, help="processes (Lightning)")
    parser.add_argument("--result", type=Path, help="rank 0 writes its figures here (JSON)")
    parser.add_argument(
        "--precision",
        choices=["default", "bf16"],
        default="default",
        help="default: the framework's own (fp32 in all three); bf16: its bf16 autocast setting",
    )
    args = parser.parse_args()
    args.total_steps = args.warmup + args.steps
    return args


def apply_thread_count() -> int:
    """The benchmark sets OMP_NUM_THREADS for every contender; we only make it explicit."""
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def in_memory_images(world_size: int, args: argparse.Namespace):
    """Random uint8 images, exactly enough for `total_steps` batches on every rank."""
    count = world_size * args.batch * args.total_steps
    generator = torch.Generator().manual_seed(args.seed)
    size = args.image_size
    images = torch.randint(0, 256, (count, 3, size, size), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (count,), generator=generator)
    return images, labels


class AugmentCollate:
    """DataLoader collate_fn: stack, random crop with padding and flip per sample, normalise.
    Done in the training process (num_workers=0), as ddpcli does with in-memory data."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.mean = torch.tensor(MEAN).view(1, 3, 1, 1)
        self.std = torch.tensor(STD).view(1, 3, 1, 1)

    def __call__(self, samples):
        images = torch.stack([image for image, _ in samples])
        labels = torch.stack([label for _, label in samples])
        count, _, height, width = images.shape
        pad = CROP_PADDING
        padded = F.pad(images, (pad, pad, pad, pad))
        offsets = torch.randint(0, 2 * pad + 1, (count, 2), generator=self.generator).tolist()
        flips = torch.rand(count, generator=self.generator).lt(0.5).tolist()
        out = torch.empty_like(images)
        for index, ((top, left), flip) in enumerate(zip(offsets, flips, strict=True)):
            crop = padded[index, :, top : top + height, left : left + width]
            out[index] = crop.flip(2) if flip else crop
        return (out.float().div_(255) - self.mean) / self.std, labels


class Throughput:
    """Images per second summed over ranks, after the first `warmup` steps. On a GPU the
    device is synchronised at the window's edges only, as ddpcli's StepTimer does; the
    Unix time the first step finished is kept for "time to first step"."""

    def __init__(self, warmup: int, device: torch.device | None = None):
        self.warmup = warmup
        self.device = device or torch.device("cpu")
        self.steps = 0
        self.images = 0
        self.first_step_at: float | None = None
        self.start = self._now() if warmup == 0 else None

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def step(self, batch_images: int) -> None:
        self.steps += 1
        if self.steps == 1:
            self._now()
            self.first_step_at = time.time()
        if self.steps == self.warmup:
            self.start = self._now()
        elif self.steps > self.warmup:
            self.images += batch_images

    def images_per_sec(self) -> float:
        elapsed = self._now() - self.start if self.start is not None else 0.0
        images = torch.tensor([float(self.images)], device=self.device)
        slowest = torch.tensor([elapsed], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(images, op=dist.ReduceOp.SUM)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return images.item() / max(slowest.item(), 1e-9)


def write_result(path: Path | None, contender: str, rate: float, steps: int, threads: int):
    if path is None or (dist.is_initialized() and dist.get_rank() != 0):
        return
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    figures = {
        "contender": contender,
        "images_per_sec": rate,
        "timed_steps": steps,
        "world_size": world_size,
        "threads_per_process": threads,
        "torch": torch.__version__,
    }
    path.write_text(json.dumps(figures) + "\n")
