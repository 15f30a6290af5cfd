"""The input pipeline per loader worker: the same JPEGs read as an image folder, as tar shards
on local disk and as shards over a local HTTP (and S3) endpoint, by ddpcli and by its peers
(torchvision's ImageFolder, the webdataset library): images per second per worker.

    python benchmarks/input_pipeline.py                     # 20,000 JPEGs, 64 and 224 px
    python benchmarks/input_pipeline.py --images 2000 --take 512 --rounds 2 --sizes 224
    python benchmarks/input_pipeline.py --accuracy --seeds 0,1,2   # digits: folder vs shards

It writes a folder of photograph-like JPEGs (smooth colour and grain, 440-500 x 330-375,
ImageNet's median size, quality 90) once, packs it with `ddpcli data pack` once, then
times, interleaved round by round so that a change in the machine's load hits every
contender alike, these contenders (each: random-resized crop at the size, flip, uint8 out):
- `ddpcli folder`: ddpcli.data.loader.FolderDataset under `--augment rrc` (ddpcli.data.decode:
  the box drawn from the JPEG's header, the JPEG decoded at a reduced scale where the box
  allows, else by libjpeg-turbo straight into a tensor without PIL, resized in uint8);
- `torchvision ImageFolder (PIL, uint8 out)`: ImageFolder, then transforms.v2's
  RandomResizedCrop (antialiased), RandomHorizontalFlip and PILToTensor on the PIL image:
  torchvision's fastest way to the same uint8 batch, the baseline of the ratios;
- `torchvision v2 on tensors` (only with --contenders): ToImage first, then the
  same on tensors, ToDtype and Normalize, as torchvision's documentation writes it;
- `ddpcli shards`: the shards streamed as `ddpcli train --dataset shards` reads them
  (ddpcli.data.shards.feed.ShardStreams: the epoch's plan, one stream per worker, the
  shuffle buffer), decoded as the folder path decodes;
- `ddpcli folder|shards bytes only (--decode gpu's workers)`: what the loader workers do
  under `--decode gpu` (ddpcli.data.encoded): read each file's bytes, its size from the JPEG
  header, draw its box; the decode, crop and resize are left to the rank's GPU, not timed
  here. How many workers a GPU's pace needs, against the two rows above;
- `webdataset`: the webdataset library's own pipeline on the same shards (WebDataset,
  shuffle, decode("pil"), to_tuple, the torchvision transform above);
- `... over HTTP`: the same, from a local HTTP server (another process) that waits
  --latency-ms before answering each request, as an object store's first byte does; the
  folder there costs one request per image (ddpcli's decode of each file fetched on a kept-
  alive connection), shards one per shard (ddpcli: per 8 MB block);
- `ddpcli shards over S3`: with --s3, from moto's S3 server on 127.0.0.1 (s3fs);
- `val view`: the validation view (shorter side resized, centre crop): ddpcli's loader
  against ImageFolder + Resize + CenterCrop + PILToTensor.

Each contender is one DataLoader with --workers workers and batches of --batch (shards:
chunks of --batch); the first --warmup batches (worker start, the shuffle buffer's fill)
are not timed, then --take images are. The figure is the loader's images/s divided by its
workers, beside the workers' CPU milliseconds per image (read from /proc: the machine's
other load moves it far less than the wall clock). Figures only: nothing here asserts speed.

--accuracy instead trains resnet18 on the digits folder of imagefolder_parity.py and on its
shards (`ddpcli data pack`), with the same seeds and flags, and prints both accuracies.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # imagefolder_parity, imagenet_sized

from imagenet_sized import smooth_colour  # noqa: E402

from ddpcli.data.augment import crop_box_one  # noqa: E402
from ddpcli.data.decode import EncodedImage, read_resized_crop  # noqa: E402
from ddpcli.data.layout import folder_classes, folder_samples, resize_side  # noqa: E402
from ddpcli.data.loader import FolderDataset  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
BASELINE = "torchvision ImageFolder (PIL, uint8 out)"
VAL_BASELINE = "val view: torchvision (PIL, uint8 out)"
CLASSES = 2
VAL_PER_CLASS = 4  # `data pack` wants a val split; nothing here reads it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/ddpcli-bench-input"))
    parser.add_argument("--images", type=int, default=20_000, help="training JPEGs to write")
    parser.add_argument("--take", type=int, default=2048, help="images timed per contender")
    parser.add_argument("--sizes", default="64,224", help="output sides, comma-separated")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10, help="batches not timed")
    parser.add_argument("--buffer", type=int, default=1000, help="shuffle buffer, samples")
    parser.add_argument("--shard-size", default="64MB", help="`data pack --shard-size`")
    parser.add_argument("--latency-ms", type=float, default=10.0, help="HTTP server's wait")
    parser.add_argument("--s3", action="store_true", help="also read shards from moto's S3")
    parser.add_argument(
        "--contenders", default="",
        help="names to run, comma-separated, each without its parenthesis (e.g. 'ddpcli "
        "folder,torchvision ImageFolder'); by default all but torchvision's tensor pipeline",
    )  # fmt: skip
    parser.add_argument(
        "--pixels", type=int, default=500, help="images whose crops are compared (0: none)"
    )
    parser.add_argument(
        "--accuracy", action="store_true",
        help="only train the digits set from its folder and from its shards (same seeds)",
    )  # fmt: skip
    parser.add_argument("--seeds", default="0,1,2", help="--accuracy's seeds")
    parser.add_argument("--epochs", type=int, default=10, help="--accuracy's epochs")
    parser.add_argument("--size", type=int, default=32, help="--accuracy's image size")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the clock starts after a batch)")
    return args


# --- the data -------------------------------------------------------------------------------


def photo(seed: int) -> np.ndarray:
    """uint8 (H, W, 3) with H, W about ImageNet's median (500 x 375, some portrait-free
    variety): smooth colour waves plus grain, so a JPEG of it is of a photograph's size."""
    rng = np.random.default_rng(seed)
    height, width = int(rng.integers(330, 376)), int(rng.integers(440, 501))
    pixels = smooth_colour(rng, height, width)
    pixels += rng.standard_normal(pixels.shape, dtype=np.float32) * 10
    return pixels.clip(0, 255).astype(np.uint8)


def write_photo(task: tuple[Path, int]) -> None:
    from PIL import Image

    path, seed = task
    Image.fromarray(photo(seed)).save(path, quality=90)


def write_folder(src: Path, count: int) -> Path:
    """SRC/train/class<k>/*.jpg (COUNT) and a small SRC/val, written once (kept for later
    runs); SRC/train."""
    tasks = []
    for split, total in (("train", count), ("val", VAL_PER_CLASS * CLASSES)):
        for index in range(total):
            folder = src / split / f"class{index % CLASSES}"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{index:05d}.jpg"
            if not path.exists():
                tasks.append((path, index if split == "train" else 10**6 + index))
    if tasks:
        print(f"writing {len(tasks)} JPEGs into {src}", file=sys.stderr)
        with multiprocessing.Pool() as pool:
            pool.map(write_photo, tasks, chunksize=64)
    return src / "train"


def pack_shards(src: Path, out: Path, shard_size: str) -> Path:
    """`ddpcli data pack SRC OUT`, once for this folder (redone if its image count changed)."""
    stamp = out / "packed-from.txt"
    images = str(sum(1 for _ in (src / "train").glob("*/*")))
    if stamp.exists() and stamp.read_text() == images:
        return out
    print(f"packing {src} into {out}", file=sys.stderr)
    command = [sys.executable, "-m", "ddpcli", "data", "pack", str(src), str(out)]
    subprocess.run([*command, "--shard-size", shard_size, "--force"], check=True)
    stamp.write_text(images)
    return out


def train_shards(out: Path) -> list[Path]:
    return sorted(out.glob("train-*.tar"))


# --- a local HTTP endpoint ------------------------------------------------------------------


def serve(root: Path, latency_s: float, port: Any) -> None:
    """Static files under ROOT on 127.0.0.1 (Range requests honoured: shards are read in
    blocks), each request answered after LATENCY_S; the port goes back through PORT."""
    import re
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Handler(SimpleHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the folder's requests reuse a connection
        disable_nagle_algorithm = True  # else a small body waits for a delayed ACK (40 ms)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = Path(self.translate_path(self.path))
            if not path.is_file():
                self.send_error(404)
                return
            size = path.stat().st_size
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            start, end = (
                (int(match[1]), min(size, int(match[2] or size - 1) + 1)) if match else (0, size)
            )
            time.sleep(latency_s)
            self.send_response(206 if match else 200)
            if match:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.send_header("Content-Length", str(end - start))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            with path.open("rb") as file:
                file.seek(start)
                self.wfile.write(file.read(end - start))

        def do_HEAD(self) -> None:  # noqa: N802
            path = Path(self.translate_path(self.path))
            if not path.is_file():
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(path.stat().st_size))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # a loader stopped after its images hangs up mid-shard: not news

    server = Server(("127.0.0.1", 0), Handler)
    port.value = server.server_address[1]
    server.serve_forever()


def start_server(root: Path, latency_ms: float) -> tuple[str, multiprocessing.Process]:
    port = multiprocessing.Value("i", 0)
    process = multiprocessing.Process(
        target=serve, args=(root, latency_ms / 1000, port), daemon=True
    )
    process.start()
    for _ in range(200):
        if port.value:
            return f"http://127.0.0.1:{port.value}", process
        time.sleep(0.05)
    raise SystemExit("the local HTTP server did not start")


def start_s3(out: Path) -> tuple[str, Any]:
    """moto's S3 server on 127.0.0.1 with the shards uploaded; their s3:// URL. The
    credentials are moto's placeholders, set in this process's environment for s3fs."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ACCESS_KEY_ID="benchmark", AWS_SECRET_ACCESS_KEY="benchmark",
        AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://{host}:{port}",
    )  # fmt: skip
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    client.create_bucket(Bucket="bench")
    for path in sorted(out.iterdir()):
        client.upload_file(str(path), "bench", f"shards/{path.name}")
    return "s3://bench/shards", server


# --- the contenders -------------------------------------------------------------------------


class Keyed(Dataset):
    """ddpcli's FolderDataset takes (index, epoch) keys: its draws depend on both."""

    def __init__(self, dataset: Dataset, epoch: int = 0) -> None:
        self.dataset, self.epoch = dataset, epoch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[(index, self.epoch)]


class FilesOverHttp(Dataset):
    """The folder's files, each fetched by its own GET (on a connection each worker keeps
    alive), decoded and cropped by ddpcli's decode as FolderDataset does."""

    def __init__(self, base: str, root: Path, train: Path, size: int) -> None:
        self.samples = folder_samples(train, folder_classes(train))
        self.paths = ["/" + str(path.relative_to(root)) for path, _ in self.samples]
        self.host = urlsplit(base).netloc
        self.size = size
        self.connection: http.client.HTTPConnection | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def fetch(self, path: str) -> bytes:
        if self.connection is None:
            self.connection = http.client.HTTPConnection(self.host)
        self.connection.request("GET", path)
        return self.connection.getresponse().read()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        data = self.fetch(self.paths[index])
        box_for = functools.partial(crop_box_one, index, 0, 0)
        source = EncodedImage(self.paths[index], data)
        return read_resized_crop(source, box_for, self.size), self.samples[index][1]


def folder_loader(ctx: Context, size: int) -> Iterable[Any]:
    samples = folder_samples(ctx.train, folder_classes(ctx.train))
    return ctx.loader(Keyed(FolderDataset(samples, size, seed=0, augment="rrc")))


def folder_bytes_loader(ctx: Context, size: int) -> Iterable[Any]:
    """--decode gpu's workers' half: each file's bytes, its header read and its box drawn;
    the decode and the crop are left to the rank's GPU (not timed here)."""
    from ddpcli.data.encoded import EncodedFiles, collate_encoded

    samples = folder_samples(ctx.train, folder_classes(ctx.train))
    return ctx.loader(Keyed(EncodedFiles(samples, seed=0, augment="rrc")), collate_encoded)


def folder_val_loader(ctx: Context, size: int) -> Iterable[Any]:
    samples = folder_samples(ctx.train, folder_classes(ctx.train))
    return ctx.loader(Keyed(FolderDataset(samples, size, seed=0, augment="none")))


def torchvision_transform(size: int) -> Any:
    from torchvision.transforms import v2

    return v2.Compose(
        [v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()]
    )


def torchvision_loader(ctx: Context, size: int) -> Iterable[Any]:
    from torchvision.datasets import ImageFolder

    return ctx.loader(ImageFolder(str(ctx.train), transform=torchvision_transform(size)))


def torchvision_tensor_loader(ctx: Context, size: int) -> Iterable[Any]:
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    transform = v2.Compose([
        v2.ToImage(),
        v2.RandomResizedCrop(size, antialias=True),
        v2.RandomHorizontalFlip(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
    ])  # fmt: skip
    return ctx.loader(ImageFolder(str(ctx.train), transform=transform))


def torchvision_val_loader(ctx: Context, size: int) -> Iterable[Any]:
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    transform = v2.Compose(
        [v2.Resize(resize_side(size), antialias=True), v2.CenterCrop(size), v2.PILToTensor()]
    )
    return ctx.loader(ImageFolder(str(ctx.train), transform=transform))


def shards_loader(location: str, ctx: Context, size: int, encoded: bool = False) -> Iterable[Any]:
    """One rank's streams as `ddpcli train --dataset shards` reads them: the epoch's plan
    dealt to this rank's workers, each streaming its part through the shuffle buffer.
    ENCODED: --decode gpu's workers' half (bytes, header, box; the rank's GPU decodes)."""
    from ddpcli.data.encoded import EncodedMembers
    from ddpcli.data.shards.feed import MemberImages, ShardStreams
    from ddpcli.data.shards.index import read_index
    from ddpcli.data.shards.plan import deal, fresh_plan, shard_table, whole_streams
    from ddpcli.data.shards.storage import shard_store

    table = shard_table(read_index(location).splits["train"])
    parts = max(1, ctx.args.workers)
    images: Any = EncodedMembers(0, "rrc") if encoded else MemberImages(size, 0, "rrc")
    streams = ShardStreams(shard_store(location), table, images, ctx.args.batch)
    plan = fresh_plan(table, seed=0, epoch=0, ranks=1, workers=parts, buffer=ctx.args.buffer)
    streams.set_parts(plan, deal(whole_streams(plan), 1, parts)[0])
    return DataLoader(
        streams, batch_size=None, num_workers=ctx.args.workers,
        prefetch_factor=4 if ctx.args.workers else None,
    )  # fmt: skip


def webdataset_loader(urls: list[str], ctx: Context, size: int) -> Iterable[Any]:
    """The webdataset library's pipeline, as its documentation writes it for ImageNet."""
    import webdataset as wds

    dataset = (
        wds.WebDataset(urls, shardshuffle=False, empty_check=False)
        .shuffle(ctx.args.buffer)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(torchvision_transform(size), int)
    )
    return DataLoader(
        dataset, batch_size=ctx.args.batch, num_workers=ctx.args.workers,
        prefetch_factor=4 if ctx.args.workers else None,
    )  # fmt: skip


class Context:
    """What the contenders read: the folder, the shards, the endpoints."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        src = args.root / "src"
        self.train = write_folder(src, args.images)
        self.shards = pack_shards(src, args.root / "shards", args.shard_size)
        self.http, self.server = start_server(args.root, args.latency_ms)
        self.s3_server: Any = None
        self.s3 = ""
        if args.s3:
            self.s3, self.s3_server = start_s3(self.shards)

    def loader(self, dataset: Dataset, collate: Any = None) -> Iterable[Any]:
        return DataLoader(
            dataset, batch_size=self.args.batch, shuffle=True, num_workers=self.args.workers,
            prefetch_factor=4 if self.args.workers else None, collate_fn=collate,
        )  # fmt: skip

    def contenders(self) -> dict[str, Callable[[int], Iterable[Any]]]:
        http_shards = [f"{self.http}/shards/{path.name}" for path in train_shards(self.shards)]
        wait = f"+{self.args.latency_ms:g} ms"
        every: dict[str, Callable[[int], Iterable[Any]]] = {
            "ddpcli folder": functools.partial(folder_loader, self),
            BASELINE: functools.partial(torchvision_loader, self),
            "ddpcli shards": functools.partial(shards_loader, str(self.shards), self),
            "ddpcli folder bytes only (--decode gpu's workers)": functools.partial(
                folder_bytes_loader, self
            ),
            "ddpcli shards bytes only (--decode gpu's workers)": functools.partial(
                shards_loader, str(self.shards), self, encoded=True
            ),
            "webdataset shards": functools.partial(
                webdataset_loader, [str(path) for path in train_shards(self.shards)], self
            ),
            f"ddpcli folder over HTTP ({wait}/file)": lambda size: self.loader(
                FilesOverHttp(self.http, self.args.root, self.train, size)
            ),
            f"ddpcli shards over HTTP ({wait}/request)": functools.partial(
                shards_loader, f"{self.http}/shards", self
            ),
            f"webdataset shards over HTTP ({wait}/shard)": functools.partial(
                webdataset_loader, http_shards, self
            ),
            "val view: ddpcli": functools.partial(folder_val_loader, self),
            VAL_BASELINE: functools.partial(torchvision_val_loader, self),
        }
        if self.s3:
            every["ddpcli shards over S3 (moto)"] = functools.partial(shards_loader, self.s3, self)
        every["torchvision v2 on tensors"] = functools.partial(torchvision_tensor_loader, self)
        chosen = [name.strip() for name in self.args.contenders.split(",") if name.strip()]
        if not chosen:
            return {name: make for name, make in every.items() if "on tensors" not in name}
        return {name: make for name, make in every.items() if name.split(" (")[0] in chosen}

    def close(self) -> None:
        self.server.terminate()
        if self.s3_server is not None:
            self.s3_server.stop()


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes PIDS used so far (/proc/PID/stat)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
    return total / os.sysconf("SC_CLK_TCK")


def measure(loader: Iterable[Any], args: argparse.Namespace) -> tuple[float, float]:
    """Over --take images after --warmup batches: the loader's images/s per worker, and its
    workers' CPU milliseconds per image (which the machine's other load barely moves)."""
    images, start, cpu_start, iterator = 0, None, 0.0, iter(loader)
    workers = [worker.pid for worker in getattr(iterator, "_workers", [])]
    try:
        for position, batch in enumerate(iterator):
            if position == args.warmup - 1:  # the clock starts once the warm-up batches are in
                start, cpu_start = time.perf_counter(), cpu_seconds(workers)
            elif position >= args.warmup:
                images += len(batch[0])
                if images >= args.take:
                    break
        cpu = cpu_seconds(workers) - cpu_start
    finally:
        del iterator  # the workers stop here, not while the next contender runs
    if start is None or not images:
        raise SystemExit("too few images for the warm-up: raise --images or lower --warmup")
    return images / (time.perf_counter() - start) / max(1, args.workers), cpu * 1000 / images


def report(results: dict[tuple[int, str], list[tuple[float, float]]], args: Any) -> None:
    print(
        f"{args.images} JPEGs, {args.workers} workers, batch {args.batch}, {args.take} images "
        f"timed per contender and round after {args.warmup} batches, {args.rounds} rounds, "
        f"shuffle buffer {args.buffer}, HTTP latency {args.latency_ms:g} ms"
    )
    print(
        f"{'px':>4}  {'contender':<46} {'img/s per worker':>16} {'range':>9} {'vs base':>7}"
        f" {'worker CPU ms/img':>17} {'vs base':>7}"
    )
    for size, name in results:
        rates = [rate for rate, _ in results[(size, name)]]
        cpu = statistics.median(cpu for _, cpu in results[(size, name)])
        base = results.get((size, VAL_BASELINE if name.startswith("val view") else BASELINE))
        rate = statistics.median(rates)
        ratio = cpu_ratio = "-"
        if base:
            ratio = f"{rate / statistics.median(r for r, _ in base):.2f}x"
            cpu_ratio = f"{statistics.median(c for _, c in base) / cpu:.2f}x" if cpu else "-"
        spread = f"{min(rates):.0f}-{max(rates):.0f}"
        cells = f"{rate:>16.1f} {spread:>9} {ratio:>7} {cpu:>17.2f} {cpu_ratio:>7}"
        print(f"{size:>4}  {name:<46} {cells}")


def pixel_differences(train: Path, sizes: list[int], count: int) -> None:
    """How far ddpcli's crops are from torchvision's (a full PIL decode, the same box cut and
    resized in uint8), over COUNT images: what the reduced-scale decode changes."""
    from ddpcli.data.augment import resized_crop_one
    from ddpcli.data.decode import dct_reduction, read_rgb

    samples = folder_samples(train, folder_classes(train))[:count]
    for size in sizes:
        reduced, differences = 0, []
        for index, (path, _) in enumerate(samples):
            box_for = functools.partial(crop_box_one, index, 0, 0)
            got = read_resized_crop(path, box_for, size).float()
            image = read_rgb(path)
            want = resized_crop_one(image, index, 0, 0, size).float()
            box = box_for(*image.shape[-2:])
            reduced += dct_reduction(box.height, box.width, size) > 1
            differences.append((got - want).abs().flatten())
        every = torch.cat(differences)
        print(
            f"{size} px: {reduced} of {len(samples)} crops decoded at a reduced scale; "
            f"|ddpcli - torchvision| over all pixels: mean {every.mean():.3f}, "
            f"99.9th percentile {every.quantile(0.999):.0f}, max {every.max():.0f} (of 255); "
            f"identical pixels {(every == 0).float().mean():.1%}"
        )


def train_accuracy(dataset: str, data: Path, args: argparse.Namespace, seed: int) -> float:
    """`ddpcli train` on DATA (2 Gloo ranks x 32, resnet18, every other flag the default):
    the final validation accuracy."""
    import json

    command = [
        sys.executable, "-m", "ddpcli", "train", "--cpu", "--nproc", "2", "--dataset", dataset,
        "--data-dir", str(data), "--arch", "resnet18", "--image-size", str(args.size),
        "--epochs", str(args.epochs), "--per-gpu-batch", "32", "--seed", str(seed),
        "--out", str(args.root / "runs" / f"{dataset}-{seed}"), "--json",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    return float(json.loads(result.stdout)["val_acc"])


def accuracy(args: argparse.Namespace) -> None:
    """The digits folder of imagefolder_parity.py, packed, trained from either with the
    same seeds: the folder's accuracy and the shards', seed by seed."""
    from imagefolder_parity import export_digits

    folder, shards = args.root / "digits", args.root / "digits-shards"
    if not (folder / "train").is_dir():
        export_digits(folder)
    pack_shards(folder, shards, "64K")  # several shards: streams split by shard, not inside
    print(f"{'seed':>4}  {'folder':>7}  {'shards':>7}  (val acc, {args.size} px, {args.epochs} ep)")
    pairs = []
    for seed in (int(seed) for seed in args.seeds.split(",")):
        pair = (train_accuracy("imagefolder", folder, args, seed),)
        pair += (train_accuracy("shards", shards, args, seed),)
        print(f"{seed:>4}  {pair[0]:>7.4f}  {pair[1]:>7.4f}", flush=True)
        pairs.append(pair)
    for name, values in zip(("folder", "shards"), zip(*pairs, strict=True), strict=True):
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"{name}: mean {statistics.fmean(values):.4f} +- {spread:.4f} (sd over seeds)")
    if len(pairs) > 1:  # the paths draw other crops and orders: two samples, not pairs
        on_folder, on_shards = zip(*pairs, strict=True)
        error = math.sqrt(sum(statistics.variance(v) / len(v) for v in (on_folder, on_shards)))
        difference = statistics.fmean(on_shards) - statistics.fmean(on_folder)
        print(f"shards - folder: {difference * 100:+.2f} points, standard error {error * 100:.2f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.accuracy:
        accuracy(args)
        return
    torch.set_num_threads(1)  # the workers' setting; the main process only collates
    ctx = Context(args)
    sizes = [int(size) for size in args.sizes.split(",")]
    results: dict[tuple[int, str], list[tuple[float, float]]] = {}
    try:
        contenders = ctx.contenders()
        for round_number in range(args.rounds):
            for size in sizes:
                for name, make in contenders.items():
                    results.setdefault((size, name), []).append(measure(make(size), args))
            print(f"round {round_number + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        ctx.close()
    report(results, args)
    if args.pixels:
        pixel_differences(ctx.train, sizes, args.pixels)


if __name__ == "__main__":
    main()
