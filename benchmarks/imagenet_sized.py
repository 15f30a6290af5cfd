"""ImageNet-sized JPEGs on local disk: an image folder, and the same images as tar shards.

    python benchmarks/imagenet_sized.py --out /data/inet           # 7,168 + 200 JPEGs
    python benchmarks/imagenet_sized.py --out /tmp/tiny --images 16 --classes 2

Writes OUT/folder/{train,val}/classNNN/*.jpg, each 400 x 350 px (about ImageNet's mean size)
at quality 90, then packs that folder with `ddpcli data pack OUT/folder OUT/shards`. The
pixels are smooth colour waves, a few filled shapes (hard edges), texture and grain, so a
file is 55-100 kB and costs what a photograph of that size costs to decode and crop; a flat
colour would be a few kB and decode several times faster. The same seed writes the same
files. Prints one JSON document: the counts, the files' sizes, the seconds each part took.

benchmarks/gpu_check.py trains resnet50 from these shards (`--decode gpu` against the CPU
loader); anything else that needs decoding to cost what ImageNet's costs can use them too.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from _machine import cpu_cores

ROOT = Path(__file__).resolve().parent.parent
WIDTH, HEIGHT = 400, 350
QUALITY = 90
VAL_PER_CLASS = 2  # `data pack` wants a val split; validation should cost little
VAL_SEED = 10**6  # val images' seeds start here, apart from the training images'


def smooth_colour(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """float32 (H, W, 3) in 0-255: three smooth colour waves, a photograph's large shapes."""
    scale = rng.uniform(20, 80)
    x, y = np.arange(width) / scale, np.arange(height)[:, None] / scale
    waves = [np.sin(x * rng.uniform(0.3, 2) + rng.uniform(0, 6)) + np.cos(y * rng.uniform(0.3, 2))
             for _ in range(3)]  # fmt: skip
    pixels = np.stack(waves, -1).astype(np.float32)
    return (pixels - pixels.min()) * (255 / np.ptp(pixels))


def photo(seed: int, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """uint8 (H, W, 3): smooth colour, 3-11 filled shapes, texture and grain. The texture
    (noise at half resolution, on every channel alike) is what brings a JPEG of it to a
    photograph's size: per-channel grain alone stops near 75 kB, as JPEG keeps little colour."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    image = Image.fromarray(smooth_colour(rng, height, width).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 12))):
        x0, x1 = sorted(int(v) for v in rng.integers(0, width, 2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, height, 2))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        kind = int(rng.integers(3))
        if kind == 0:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        elif kind == 1:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
        else:
            corners = zip(rng.integers(0, width, 3), rng.integers(0, height, 3), strict=True)
            draw.polygon([(int(x), int(y)) for x, y in corners], fill=colour)
    pixels = np.asarray(image, dtype=np.float32)
    coarse = rng.standard_normal((height // 2, width // 2), dtype=np.float32)
    texture = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC))
    pixels = pixels + texture[..., None] * rng.uniform(15, 80)
    pixels += rng.standard_normal(pixels.shape, dtype=np.float32) * rng.uniform(6, 20)
    return pixels.clip(0, 255).astype(np.uint8)


def write_photo(task: tuple[Path, int]) -> int:
    from PIL import Image

    path, seed = task
    Image.fromarray(photo(seed)).save(path, "JPEG", quality=QUALITY)
    return path.stat().st_size


def folder_tasks(folder: Path, images: int, val_images: int, classes: int) -> list:
    """(path, seed) of every file: image i of a split in class i mod CLASSES."""
    tasks = []
    for split, count, first_seed in (("train", images, 0), ("val", val_images, VAL_SEED)):
        for index in range(count):
            label = folder / split / f"class{index % classes:03d}"
            tasks.append((label / f"{index:06d}.jpg", first_seed + index))
    return tasks


def write_folder(tasks: list, workers: int) -> list[int]:
    """Every file, on WORKERS processes; the files' sizes in bytes."""
    for folder in {path.parent for path, _ in tasks}:
        folder.mkdir(parents=True, exist_ok=True)
    with multiprocessing.Pool(workers) as pool:
        return pool.map(write_photo, tasks, chunksize=max(1, len(tasks) // (8 * workers)))


def pack(folder: Path, shards: Path, shard_size: str) -> dict:
    """`ddpcli data pack FOLDER SHARDS`, with this checkout first on the path (a machine
    that has not `pip install -e .`'d it runs the same code)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "ddpcli", "data", "pack", str(folder), str(shards),
               "--shard-size", shard_size, "--json"]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": path}
    )
    if done.returncode != 0:
        sys.exit(f"imagenet_sized: `ddpcli data pack` failed ({done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="writes OUT/folder, OUT/shards")
    parser.add_argument("--images", type=int, default=7168, help="training JPEGs")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--val-images", type=int, help=f"default {VAL_PER_CLASS} per class")
    parser.add_argument("--shard-size", default="256MB", help="`ddpcli data pack --shard-size`")
    parser.add_argument("--workers", type=int, help="processes writing JPEGs; default: cores")
    args = parser.parse_args(argv)
    if not 2 <= args.classes <= args.images:
        parser.error("--classes must be at least 2 (an image folder's), at most --images")
    for part in ("folder", "shards"):
        if (args.out / part).exists() and any((args.out / part).iterdir()):
            parser.error(f"{args.out / part} exists and is not empty: give a new --out")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    folder, shards = args.out / "folder", args.out / "shards"
    val_images = args.val_images if args.val_images is not None else VAL_PER_CLASS * args.classes
    tasks = folder_tasks(folder, args.images, val_images, args.classes)
    print(f"writing {len(tasks)} JPEGs of {WIDTH} x {HEIGHT} px into {folder}", file=sys.stderr)
    started = time.perf_counter()
    sizes_kb = np.array(write_folder(tasks, args.workers or cpu_cores())) / 1024
    written = time.perf_counter()
    packed = pack(folder, shards, args.shard_size)
    report = {
        "folder": str(folder),
        "shards": str(shards),
        "train_images": args.images,
        "val_images": val_images,
        "classes": args.classes,
        "width": WIDTH,
        "height": HEIGHT,
        "quality": QUALITY,
        "kB": {"mean": sizes_kb.mean(), "min": sizes_kb.min(), "max": sizes_kb.max()},
        "write_s": written - started,
        "pack_s": time.perf_counter() - written,
        "pack": packed,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
