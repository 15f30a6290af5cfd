"""The loader path for image folders against torchvision's ImageFolder + transforms.v2, with
the same DataLoader workers, on JPEGs of ImageNet size: images per second per worker.

    python benchmarks/input_pipeline.py                          # 64 and 224 px, 2 workers
    python benchmarks/input_pipeline.py --sizes 224 --workers 4 --images 512 --rounds 5

It writes a folder of photograph-like JPEGs (smooth colour and grain, 440-500 x 330-375,
quality 90) once, then times, interleaved round by round so that a change in the machine's
load hits every contender alike:
- `ddpcli`: ddpcli.data.loader.FolderDataset under `--augment rrc`: the box drawn as a pure
  function of (seed, epoch, index), the JPEG decoded at the smallest scale that keeps the box
  at least the output size (PIL draft), cut and resized in uint8, mirrored; uint8 out
  (ddpcli normalises on the device);
- `torchvision v2 (tensor)`: ImageFolder, then the transforms.v2 pipeline its documentation
  recommends: ToImage, RandomResizedCrop (antialiased), RandomHorizontalFlip,
  ToDtype(float32, scale=True), Normalize;
- `torchvision v2 (PIL, uint8 out)`: the same crop and flip on the PIL image, then
  PILToTensor: torchvision's cheapest way to the same uint8 batch as ddpcli's.

Each contender is one DataLoader with --workers workers and batches of --batch; the first
--warmup batches (worker start, first decodes) are not timed. The figure is images/s of the
loader divided by its workers. Figures only: nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddpcli.data.layout import folder_classes, folder_samples  # noqa: E402
from ddpcli.data.loader import FolderDataset  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/ddpcli-bench-jpegs"))
    parser.add_argument("--images", type=int, default=256, help="JPEGs to write (2 classes)")
    parser.add_argument("--sizes", default="64,224", help="output sides, comma-separated")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="batches not timed per round")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the clock starts after a batch)")
    return args


def photo(seed: int) -> np.ndarray:
    """uint8 (H, W, 3) with H, W about ImageNet's median (500 x 375, some portrait-free
    variety): smooth colour waves plus grain, so a JPEG of it is of a photograph's size."""
    rng = np.random.default_rng(seed)
    height, width = int(rng.integers(330, 376)), int(rng.integers(440, 501))
    y, x = np.mgrid[0:height, 0:width] / rng.uniform(20, 80)
    waves = [np.sin(x * rng.uniform(0.3, 2) + rng.uniform(0, 6)) + np.cos(y * rng.uniform(0.3, 2))
             for _ in range(3)]  # fmt: skip
    pixels = np.stack(waves, -1)
    pixels = (pixels - pixels.min()) / np.ptp(pixels) * 255 + rng.normal(0, 10, pixels.shape)
    return pixels.clip(0, 255).astype(np.uint8)


def write_folder(root: Path, count: int) -> Path:
    """ROOT/train/<class>/*.jpg, written once (kept for later runs)."""
    from PIL import Image

    train = root / "train"
    if len(list(train.glob("*/*.jpg"))) >= count:
        return train
    for index in range(count):
        folder = train / f"class{index % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(photo(index)).save(folder / f"{index:05d}.jpg", quality=90)
    return train


class Keyed(Dataset):
    """ddpcli's FolderDataset takes (index, epoch) keys: its draws depend on both."""

    def __init__(self, dataset: FolderDataset, epoch: int) -> None:
        self.dataset, self.epoch = dataset, epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset[(index, self.epoch)]


def ddpcli_dataset(train: Path, size: int) -> Dataset:
    samples = folder_samples(train, folder_classes(train))
    return Keyed(FolderDataset(samples, size, seed=0, augment="rrc"), epoch=0)


def torchvision_tensor_dataset(train: Path, size: int) -> Dataset:
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    transform = v2.Compose([
        v2.ToImage(),
        v2.RandomResizedCrop(size, antialias=True),
        v2.RandomHorizontalFlip(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
    ])  # fmt: skip
    return ImageFolder(str(train), transform=transform)


def torchvision_pil_dataset(train: Path, size: int) -> Dataset:
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    transform = v2.Compose(
        [v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()]
    )
    return ImageFolder(str(train), transform=transform)


CONTENDERS: dict[str, Callable[[Path, int], Dataset]] = {
    "ddpcli": ddpcli_dataset,
    "torchvision v2 (tensor)": torchvision_tensor_dataset,
    "torchvision v2 (PIL, uint8 out)": torchvision_pil_dataset,
}


def images_per_sec_per_worker(dataset: Dataset, args: argparse.Namespace) -> float:
    loader = DataLoader(
        dataset, batch_size=args.batch, shuffle=True, num_workers=args.workers,
        prefetch_factor=4 if args.workers else None, drop_last=True,
    )  # fmt: skip
    images, start = 0, None
    for position, (batch, _) in enumerate(loader):
        if position == args.warmup - 1:  # the clock starts once the warm-up batches are in
            start = time.perf_counter()
        elif position >= args.warmup:
            images += len(batch)
    if start is None or not images:
        raise SystemExit("too few images for the warm-up: raise --images or lower --warmup")
    return images / (time.perf_counter() - start) / max(1, args.workers)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the workers' setting; the main process only collates
    train = write_folder(args.folder, args.images)
    sizes = [int(size) for size in args.sizes.split(",")]
    results: dict[tuple[int, str], list[float]] = {}
    for round_number in range(args.rounds):
        for size in sizes:
            for name, make in CONTENDERS.items():
                rate = images_per_sec_per_worker(make(train, size), args)
                results.setdefault((size, name), []).append(rate)
        print(f"round {round_number + 1}/{args.rounds} done", file=sys.stderr)
    print(f"{args.images} JPEGs in {train}, {args.workers} workers, batch {args.batch}")
    print(f"{'px':>4}  {'contender':<32} {'img/s per worker':>17} {'range':>15}  vs torchvision")
    for size in sizes:
        baseline = statistics.median(results[(size, "torchvision v2 (tensor)")])
        for name in CONTENDERS:
            rates = results[(size, name)]
            median = statistics.median(rates)
            spread = f"{min(rates):.0f}-{max(rates):.0f}"
            print(f"{size:>4}  {name:<32} {median:>17.1f} {spread:>15}  {median / baseline:.2f}x")


if __name__ == "__main__":
    main()
