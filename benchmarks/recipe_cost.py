"""What each ingredient of the modern recipe costs the input path, without a model: the
milliseconds one thread spends on a batch, and the images per second that makes, side by
side in one run with the default crop it is added to.

    python benchmarks/recipe_cost.py                   # 32 and 224 px, batch 64
    python benchmarks/recipe_cost.py --sizes 64 --batch 128 --repeats 30

Each ingredient runs the function ddpcli's data paths call, on the batch those paths hand it:
  auto-augment (ta_wide, randaugment, autoaugment)  uint8 images, one policy draw per image
      (in a loader worker per image, on the device path per batch: the same call)
  random erasing (--random-erase 0.1)                float images, after normalisation
  Mixup 0.2 / CutMix 1.0 (one of the two per batch)   float images and labels, in the step
The default crop (`rrc` on the device path, from a stored side of size / 0.875) is timed the
same way, for scale. One thread (a loader worker's, or a rank's share of a small machine),
this process's CPU time: on a shared machine wall time would count other processes too.
Figures only; nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from augment_cost import device_batch_ms, median_ms  # noqa: E402  (a sibling script)

from ddpcli.data.autoaugment import auto_augment_images, policy_transform  # noqa: E402
from ddpcli.data.erasing import erase_images  # noqa: E402
from ddpcli.data.mixing import BatchMixing  # noqa: E402

POLICIES = ("ta_wide", "randaugment", "autoaugment")
CPU = torch.device("cpu")


def ingredient_ms(size: int, batch: int, repeats: int) -> dict[str, float]:
    """Milliseconds per batch of BATCH images at SIZE px, by ingredient."""
    pixels = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8)
    floats = pixels.float().div(255)
    labels = torch.randint(0, 10, (batch,))
    keys = torch.arange(batch)
    times = {"rrc (the default crop, for scale)": device_batch_ms("rrc", size, batch, CPU, repeats)}
    for name in POLICIES:
        policy = policy_transform(name)
        times[f"--auto-augment {name}"] = median_ms(
            lambda policy=policy: auto_augment_images(pixels, keys, 0, 0, policy), repeats, CPU
        )
    times["--random-erase 0.1"] = median_ms(
        lambda: erase_images(floats, keys, 0, 0, 0.1), repeats, CPU
    )
    mixing = BatchMixing(0.2, 1.0, num_classes=10, seed=0)
    steps = iter(range(10**9))  # a new batch key each call: Mixup and CutMix both drawn
    times["--mixup-alpha 0.2 --cutmix-alpha 1.0"] = median_ms(
        lambda: mixing(floats, labels, 0, next(steps)), repeats, CPU
    )
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32,224", help="image sides, comma-separated")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"batch {args.batch}, one thread, CPU time, median of {args.repeats}\n")
    print("| px | ingredient | ms per batch | img/s on one thread | vs the default crop |")
    print("|---:|---|---:|---:|---:|")
    for size in (int(side) for side in args.sizes.split(",")):
        times = ingredient_ms(size, args.batch, args.repeats)
        base = next(iter(times.values()))
        for name, ms in times.items():
            rate = args.batch / ms * 1e3
            print(f"| {size} | {name} | {ms:.2f} | {rate:,.0f} | {ms / base:.2f}x |")


if __name__ == "__main__":
    main()
