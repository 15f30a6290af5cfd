"""What each `--augment` costs, without a model: milliseconds per batch on the device path
and per image on the loader path.

    python benchmarks/augment_cost.py                       # the CPU, and a GPU if there is one
    python benchmarks/augment_cost.py --size 224 --batch 256 --repeats 20

Device path: a batch gathered from the uint8 set in device memory, augmented and
normalised (DeviceResidentBatches): `rrc` resamples each image's box from the whole image
kept at size / 0.875 in one grid_sample, `crop-flip` crops the padded image at the size,
`none` only gathers. Loader path: the transform of one decoded 500x375 photograph-sized
image in a worker, decoding excluded: `rrc` (box drawn, cut, resized with antialiasing)
against validation's resize and centre crop, which `crop-flip` and `none` start from.
Single-threaded on the CPU (a loader worker's setting); figures only, nothing here asserts
speed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ddpcli.data.augment import crop_and_flip_one, resized_crop_one
from ddpcli.data.device import DeviceResidentBatches
from ddpcli.data.layout import Augment, resize_side
from ddpcli.data.sets import ImageSet, centre_view

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
CHOICES: tuple[Augment, ...] = ("rrc", "crop-flip", "none")


def median_ms(work, repeats: int, device: torch.device) -> float:
    """On the CPU, this process's CPU time: on a shared machine, wall time also counts the
    time slices other processes took."""
    work()  # warm-up: kernels, allocator
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((clock() - start) * 1e3)
    return statistics.median(times)


def device_batch_ms(choice: Augment, size: int, batch: int, device: torch.device, repeats: int):
    side = resize_side(size) if choice == "rrc" else size
    images = torch.randint(0, 256, (batch * 4, 3, side, side), dtype=torch.uint8)
    sizes = torch.tensor([[375, 500]]).expand(len(images), 2) if choice == "rrc" else None
    image_set = ImageSet(images.to(device), torch.zeros(len(images), dtype=torch.long), sizes)
    indices = torch.randperm(len(images))[:batch].tolist()
    batches = DeviceResidentBatches(
        image_set, indices, batch, device, MEAN, STD, choice, seed=0, epoch=0,
        channels_last=device.type == "cuda", image_size=size,
    )  # fmt: skip
    return median_ms(lambda: next(iter(batches)), repeats, device)


def loader_image_ms(choice: Augment, size: int, repeats: int) -> float:
    image = torch.randint(0, 256, (3, 375, 500), dtype=torch.uint8)
    cpu = torch.device("cpu")
    if choice == "rrc":
        return median_ms(lambda: resized_crop_one(image, 7, 0, 0, size), repeats, cpu)
    if choice == "crop-flip":
        return median_ms(lambda: crop_and_flip_one(centre_view(image, size), 7, 0, 0), repeats, cpu)
    return median_ms(lambda: centre_view(image, size), repeats, cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a rank's share of a small machine; also a loader worker's
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    print(f"size {args.size}, batch {args.batch}, median of {args.repeats}")
    for device in devices:
        for choice in CHOICES:
            ms = device_batch_ms(choice, args.size, args.batch, device, args.repeats)
            print(f"device path on {device.type:<4} {choice:<9} {ms:8.2f} ms per batch")
    for choice in CHOICES:
        ms = loader_image_ms(choice, args.size, args.repeats)
        print(f"loader, one 500x375 image {choice:<9} {ms:8.2f} ms per image")


if __name__ == "__main__":
    main()
