"""Does `ddpcli train` run at the speed of the device, or at the speed of its data path?

    python benchmarks/gpu_throughput.py                  # a GPU machine: uses every GPU
    python benchmarks/gpu_throughput.py --cpu            # tiny settings, Gloo on the CPU
    python benchmarks/gpu_throughput.py --rounds 3 --json results.json
    python benchmarks/gpu_throughput.py --data-dir data  # adds STL-10 if data/stl10_binary

Every contender is a process tree started from here, with a timeout, at the same model,
image size, per-process batch, precision and world size. Rounds are interleaved, so a
change in the machine's load hits every contender alike; tables show medians.

 1. Throughput, time from command to first optimizer step, peak memory per GPU (on the
    CPU: peak RSS per rank) and MFU (the FLOP/s of one GPU, over its peak dense bf16 FLOP/s), for
      ddpcli, synthetic set in device memory        (--data-path device)
      ddpcli, JPEG folder decoded once into memory  (--dataset imagefolder --data-path device)
      ddpcli, JPEG folder through DataLoader workers (--data-path loader)
      ddpcli, STL-10 in device memory               (with --data-dir)
      minimal hand-written DDP loop                 (peers/minimal_ddp_loop.py)
      torchvision reference recipe's data pipeline  (peers/reference_pipeline.py)
    The JPEG folder is written here from the synthetic set (the same pixels), so "files"
    against "synthetic" isolates the cost of reading and decoding.
 1b. MFU where the GPU, not the launch of its kernels, sets the pace: resnet50 at 224 px
    (ddpcli and the minimal loop; resnet18 at 96 px is launch-bound on an H100).
 2. Each data path alone, without a model: images/s it hands to the device per rank,
    against the training rate per rank. Where the first is not well above the second,
    the data path is the bottleneck.
 3. Scaling of ddpcli (synthetic, device path) from 1 to every GPU (CPU: 1..--nproc).
 4. The legacy strategies, ddp against dp and balanced-dp, on 2 or more GPUs.
 5. Decoding the JPEGs: PIL against torchvision.io (and nvjpeg on a GPU), ms per image.

Figures only; nothing here asserts speed. FLOPs per image are counted with
torch.utils.flop_counter (forward) x 3 for forward and backward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from _bounded import run_bounded
from _machine import cpu_cores, cpu_model

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(__file__).resolve().parent / "peers"
WARMUP_STEPS = 3  # ddpcli.training.metrics.TIMING_WARMUP_STEPS; the peers use the same
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip
# Dense (not sparse: the datasheets' headline figures are twice these) bf16 tensor-core
# peaks, TFLOP/s; the first name contained in torch.cuda.get_device_name() wins, so the
# specific ones come first. The NVL and PCIe cards run at lower clocks and power than SXM.
PEAK_BF16_TFLOPS = [
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H200 NVL", 835.0),
    ("H100", 989.0),  # SXM ("H100 80GB HBM3")
    ("H200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),  # after L40S and L40, whose names contain it
]
# The compute-bound model MFU is quoted at (table 1b): arch, image size, per-process batch.
MFU_MODEL = ("resnet50", 224, 64)


@dataclass(frozen=True)
class Setup:
    """One measured configuration, the same for every contender."""

    cpu: bool
    arch: str
    image_size: int
    batch: int  # per process
    steps: int  # timed, after WARMUP_STEPS untimed
    nproc: int  # ranks of the comparison table
    max_nproc: int  # scaling goes 1..max_nproc
    workers: int  # DataLoader workers per rank: ddpcli's loader path and the reference
    precision: str
    threads: int  # torch threads per rank (OMP_NUM_THREADS)

    @property
    def total_steps(self) -> int:
        return WARMUP_STEPS + self.steps


@dataclass
class Contender:
    name: str
    label: str
    script: str | None = None  # a peer under benchmarks/peers/, else ddpcli
    ddpcli_args: tuple[str, ...] = ()
    peer_args: tuple[str, ...] = ()
    nproc: int | None = None  # None: the setup's
    per_process_batch: int | None = None  # None: the setup's
    arch: str | None = None  # None: the setup's
    image_size: int | None = None  # None: the setup's

    def model(self, setup: Setup) -> tuple[str, int]:
        return self.arch or setup.arch, self.image_size or setup.image_size


@dataclass
class Run:
    contender: str
    round: int
    wall_s: float
    images_per_sec: float | None = None
    first_step_s: float | None = None
    peak_memory_mb: list[float] = field(default_factory=list)  # per GPU; per rank on the CPU
    error: str | None = None


# --- Running one contender ------------------------------------------------------------------


def clean_environment(setup: Setup) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(setup.threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONWARNINGS"] = "ignore"
    return env


def command(contender: Contender, setup: Setup, scratch: Path) -> list[str]:
    nproc = contender.nproc or setup.nproc
    return cpu_pinning(setup, nproc) + contender_command(contender, setup, scratch, nproc)


def cpu_pinning(setup: Setup, nproc: int) -> list[str]:
    """On the CPU a rank is `threads` cores, as a rank is one GPU: pin the run to its cores.
    Unpinned, one rank's OpenMP threads compete with the rest of a shared machine (seen on
    a shared 2-core machine: a 1-rank run at 54 img/s unpinned, 212 img/s on one core)."""
    cores = min(nproc * setup.threads, len(os.sched_getaffinity(0)))
    if not setup.cpu or not shutil.which("taskset"):
        return []
    return [
        "taskset",
        "-c",
        ",".join(str(core) for core in sorted(os.sched_getaffinity(0))[:cores]),
    ]


def contender_command(contender: Contender, setup: Setup, scratch: Path, nproc: int) -> list[str]:
    batch = contender.per_process_batch or setup.batch
    arch, image_size = contender.model(setup)
    if contender.script is None:
        devices = (
            ["--cpu", "--nproc", str(nproc)]
            if setup.cpu
            else ["--gpus", ",".join(str(gpu) for gpu in range(nproc))]
        )
        # The device path has no loader: --workers there is refused.
        on_device = "device" in contender.ddpcli_args
        workers = [] if on_device else ["--workers", str(setup.workers)]
        return [
            sys.executable, "-m", "ddpcli", "train", *devices,
            "--arch", arch, "--image-size", str(image_size),
            "--per-gpu-batch", str(batch), "--precision", setup.precision,
            "--epochs", "1", "--max-steps", str(setup.total_steps),
            *workers, "--out", str(scratch / "out"), *contender.ddpcli_args,
        ]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [
        *torchrun, "--nproc-per-node", str(nproc), str(PEERS / contender.script),
        "--arch", arch, "--image-size", str(image_size), "--batch", str(batch),
        "--steps", str(setup.steps), "--warmup", str(WARMUP_STEPS),
        "--precision", setup.precision, "--result", str(scratch / "result.json"),
        *(["--cpu"] if setup.cpu else []), *contender.peer_args,
    ]  # fmt: skip


def read_figures(contender: Contender, scratch: Path) -> dict:
    if contender.script is None:
        lines = (scratch / "out" / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])
    return json.loads((scratch / "result.json").read_text())


def run_contender(contender: Contender, setup: Setup, round_: int, timeout_s: float) -> Run:
    with tempfile.TemporaryDirectory(prefix=f"gpu-bench-{contender.name}-") as tmp:
        scratch = Path(tmp)
        log = scratch / "output.log"
        started_at = time.time()
        code, wall_s = run_bounded(
            command(contender, setup, scratch), clean_environment(setup), ROOT, log, timeout_s
        )
        run = Run(contender.name, round_, wall_s)
        if code != 0:
            tail = log.read_text(errors="replace").strip().splitlines()[-4:]
            run.error = ("timed out" if code == 124 else f"exit {code}") + ": " + " | ".join(tail)
            return run
        try:
            figures = read_figures(contender, scratch)
        except (OSError, ValueError, IndexError) as error:
            run.error = f"no result: {error}"
            return run
        run.images_per_sec = figures["images_per_sec"]
        if figures.get("first_step_at"):
            run.first_step_s = figures["first_step_at"] - started_at
        run.peak_memory_mb = figures.get("peak_memory_mb") or figures.get("peak_rss_mb", [])
        return run


# --- The contenders -------------------------------------------------------------------------


def comparison_contenders(setup: Setup, jpeg_dir: Path, stl10_dir: Path | None) -> list:
    synthetic = ("--dataset", "synthetic", "--synthetic-size",
                 str(setup.nproc * setup.batch * setup.total_steps))  # fmt: skip
    folder = ("--dataset", "imagefolder", "--data-dir", str(jpeg_dir))
    peer = ("--data-dir", str(jpeg_dir), "--workers", str(setup.workers))
    contenders = [
        Contender("ddpcli_synthetic_device", "ddpcli · synthetic · device path",
                  ddpcli_args=(*synthetic, "--data-path", "device")),
        Contender("ddpcli_jpeg_device", "ddpcli · JPEG folder · device path",
                  ddpcli_args=(*folder, "--data-path", "device")),
        Contender("ddpcli_jpeg_loader", f"ddpcli · JPEG folder · loader ({setup.workers} w)",
                  ddpcli_args=(*folder, "--data-path", "loader")),
        Contender("minimal_loop", "minimal DDP loop · random · device",
                  script="minimal_ddp_loop.py"),
        Contender("reference", f"reference recipe · JPEG · PIL ({setup.workers} w)",
                  script="reference_pipeline.py", peer_args=peer),
    ]  # fmt: skip
    if stl10_dir is not None:
        stl10 = ("--dataset", "stl10", "--data-dir", str(stl10_dir), "--data-path", "device")
        contenders.insert(1, Contender("ddpcli_stl10_device", "ddpcli · STL-10 · device path",
                                       ddpcli_args=stl10))  # fmt: skip
    return contenders


def mfu_contenders(setup: Setup) -> list[Contender]:
    """ddpcli and the minimal loop at MFU_MODEL, on the GPU only (the CPU has no peak)."""
    if setup.cpu:
        return []
    arch, size, batch = MFU_MODEL
    model = dict(arch=arch, image_size=size, per_process_batch=batch)
    synthetic = ("--dataset", "synthetic", "--synthetic-size",
                 str(setup.nproc * batch * setup.total_steps), "--data-path", "device")  # fmt: skip
    return [
        Contender("mfu_ddpcli", f"ddpcli · {arch} {size} px · device path",
                  ddpcli_args=synthetic, **model),
        Contender("mfu_minimal_loop", f"minimal DDP loop · {arch} {size} px",
                  script="minimal_ddp_loop.py", **model),
    ]  # fmt: skip


def scaling_contenders(setup: Setup) -> list[Contender]:
    counts = sorted({1, 2, 4, 8, setup.max_nproc} & set(range(1, setup.max_nproc + 1)))
    return [
        Contender(
            f"scale_{count}",
            f"ddpcli · synthetic · device · {count} rank(s)",
            ddpcli_args=(
                "--dataset",
                "synthetic",
                "--synthetic-size",
                str(count * setup.batch * setup.total_steps),
                "--data-path",
                "device",
            ),
            nproc=count,
        )  # fmt: skip
        for count in counts
        if count != setup.nproc  # that one is the comparison table's first row
    ]


def strategy_contenders(setup: Setup, gpus: int) -> list[Contender]:
    """Same global batch for all three: dp's one process takes batch x GPUs."""
    if setup.cpu or gpus < 2:
        return []
    size = (
        "--dataset",
        "synthetic",
        "--synthetic-size",
        str(gpus * setup.batch * setup.total_steps),
    )
    one_process = setup.batch * gpus
    gpu0 = setup.batch // 2
    return [
        Contender("strategy_ddp", f"ddp · {gpus} processes", ddpcli_args=(*size,), nproc=gpus),
        Contender("strategy_dp", "dp · 1 process", ddpcli_args=(*size, "--strategy", "dp"),
                  nproc=gpus, per_process_batch=one_process),
        Contender("strategy_balanced", f"balanced-dp · GPU 0 takes {gpu0}",
                  ddpcli_args=(*size, "--strategy", "balanced-dp", "--gpu0-batch", str(gpu0)),
                  nproc=gpus, per_process_batch=one_process),
    ]  # fmt: skip


# --- Data the contenders read ---------------------------------------------------------------


def write_jpeg_folder(root: Path, count: int, image_size: int) -> None:
    """The synthetic set's pixels as JPEG files in the ImageNet layout."""
    from PIL import Image

    from ddpcli.data.sets import synthetic_splits

    splits = synthetic_splits(count, image_size, seed=0)
    for split, image_set in (("train", splits.train), ("val", splits.val)):
        pixels = image_set.images.permute(0, 2, 3, 1).numpy()
        for index, label in enumerate(image_set.labels.tolist()):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels[index]).save(folder / f"{index:06d}.jpg", quality=90)


# --- Measurements inside one process (run as a child: `--measure-in-process`) --------------


def measure_in_process(setup: Setup, jpeg_dir: Path, out: Path) -> None:
    """Data paths alone, JPEG decoding, FLOPs per image and the GPU's peak: one child
    process, so that this script itself never holds a CUDA context."""
    import torch

    torch.set_num_threads(setup.threads)
    device = torch.device("cpu" if setup.cpu else "cuda", 0)
    figures = {
        "data_paths": data_path_rates(setup, jpeg_dir, device),
        "decode_ms": decode_times(jpeg_dir, device),
        "train_gflop_per_image": train_gflop_per_image(setup.arch, setup.image_size),
        "mfu_gflop_per_image": 0.0 if setup.cpu else train_gflop_per_image(*MFU_MODEL[:2]),
        "device_name": device_name(device),
    }
    out.write_text(json.dumps(figures) + "\n")


def data_path_rates(setup: Setup, jpeg_dir: Path, device) -> dict[str, float]:
    """Images/s each data path hands to the device for rank 0 of the comparison world."""

    from ddpcli.config import TrainConfig
    from ddpcli.data.pipeline import DataPipeline
    from ddpcli.data.sets import load_splits
    from ddpcli.dist import DistContext

    sys.path.insert(0, str(PEERS))
    from reference_pipeline import reference_loader

    ctx = DistContext(0, 0, setup.nproc, setup.nproc, 0, device, "gloo")
    common = dict(arch=setup.arch, image_size=setup.image_size, per_gpu_batch=setup.batch,
                  workers=setup.workers, cpu=setup.cpu, out=jpeg_dir.parent)  # fmt: skip
    size = setup.nproc * setup.batch * setup.total_steps
    synthetic = TrainConfig(dataset="synthetic", synthetic_size=size, **common)
    folder = TrainConfig(dataset="imagefolder", data_dir=jpeg_dir, **common)
    device_path = DataPipeline(load_splits(synthetic, ctx, True), synthetic, ctx, True)
    loader_path = DataPipeline(load_splits(folder, ctx, False), folder, ctx, False)
    reference = reference_loader(jpeg_dir / "train", setup.image_size, setup.batch,
                                 setup.workers, setup.nproc, 0)  # fmt: skip

    def to_device(batches):
        for images, labels in batches:
            yield images.to(device), labels.to(device)  # as the recipe's loop does

    return {
        "ddpcli_synthetic_device": batches_per_sec(device_path.train_batches(0), setup, device),
        "ddpcli_jpeg_loader": batches_per_sec(loader_path.train_batches(0), setup, device),
        "reference": batches_per_sec(to_device(reference), setup, device),
    }


def batches_per_sec(batches, setup: Setup, device) -> float:
    """Images/s over the batches after the first WARMUP_STEPS (workers starting, caches)."""
    import torch

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    start, images = None, 0
    for position, (batch, _) in enumerate(batches, start=1):
        if position == WARMUP_STEPS:
            synchronize()
            start = time.perf_counter()
        elif position > WARMUP_STEPS:
            images += len(batch)
        if position == setup.total_steps:
            break
    synchronize()
    return images / (time.perf_counter() - start) if start and images else 0.0


def decode_times(jpeg_dir: Path, device, count: int = 200) -> dict[str, float]:
    """ms per image, one thread: PIL (what ddpcli and the recipe use), torchvision.io on
    the CPU, and nvjpeg (torchvision.io on the GPU, batched) where there is a GPU."""
    import warnings

    import torch
    import torchvision.io
    from PIL import Image
    from torchvision.transforms.v2.functional import pil_to_tensor

    paths = sorted((jpeg_dir / "train").rglob("*.jpg"))[:count]
    encoded = [torchvision.io.read_file(str(path)) for path in paths]
    torch.set_num_threads(1)
    start = time.perf_counter()
    for path in paths:
        with Image.open(path) as image:
            pil_to_tensor(image.convert("RGB"))
    times = {"PIL": (time.perf_counter() - start) * 1000 / len(paths)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision 0.29 deprecates torchvision.io decoders
        start = time.perf_counter()
        for data in encoded:
            torchvision.io.decode_jpeg(data, mode=torchvision.io.ImageReadMode.RGB)
        times["torchvision.io (CPU)"] = (time.perf_counter() - start) * 1000 / len(paths)
        if device.type == "cuda":
            torchvision.io.decode_jpeg(encoded[:8], device=device)  # nvjpeg's start-up
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            torchvision.io.decode_jpeg(encoded, device=device)
            torch.cuda.synchronize(device)
            times["torchvision.io (nvjpeg, batched)"] = (
                (time.perf_counter() - start) * 1000 / len(paths)
            )
    return times


def train_gflop_per_image(arch: str, image_size: int) -> float:
    """As `--precision auto` counts it: one image's forward x 3 (backward about twice it)."""
    from ddpcli.training.precision import training_gflop_per_image

    return training_gflop_per_image(arch, image_size)


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def peak_tflops(name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def tflops_per_gpu(images_per_sec: float, gflop_per_image: float, gpus: int) -> float:
    """The FLOP/s one GPU does, in TFLOP/s: `images_per_sec` is summed over every rank."""
    return images_per_sec * gflop_per_image / 1e3 / gpus


def mfu(images_per_sec: float, gflop_per_image: float, gpus: int, peak: float) -> float:
    """Model FLOPs utilisation: one GPU's achieved FLOP/s over its peak (both TFLOP/s)."""
    return tflops_per_gpu(images_per_sec, gflop_per_image, gpus) / peak


# --- Reporting ------------------------------------------------------------------------------


def median_of(runs: list[Run], name: str, key: str) -> float | None:
    values = [getattr(r, key) for r in runs if r.contender == name and getattr(r, key)]
    return statistics.median(values) if values else None


def spread(runs: list[Run], name: str) -> str:
    values = [r.images_per_sec for r in runs if r.contender == name and r.images_per_sec]
    return f"{min(values):.0f}-{max(values):.0f}" if len(values) > 1 else "-"


def median_memory(runs: list[Run], name: str) -> str:
    lists = [r.peak_memory_mb for r in runs if r.contender == name and r.peak_memory_mb]
    if not lists:
        return "-"
    return "/".join(f"{statistics.median(values):.0f}" for values in zip(*lists, strict=True))


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_comparison(runs, contenders, setup: Setup, measured: dict, peak: float | None):
    gflop = measured["train_gflop_per_image"]
    memory = "peak RSS MB/rank" if setup.cpu else "peak GPU MB/rank"
    flops = "MFU % bf16" if peak else "TFLOP/s/rank"
    print(
        f"\n1. throughput: {setup.arch}, {setup.image_size} px, per-process batch {setup.batch}, "
        f"{setup.nproc} rank(s), {setup.precision}, {setup.steps} steps timed after "
        f"{WARMUP_STEPS}; {gflop:.3f} GFLOP per training image"
    )
    print(f"{'contender':<44}{'img/s':>10}{'range':>12}{'1st step s':>12}{memory:>19}{flops:>13}")
    for contender in contenders:
        rate = median_of(runs, contender.name, "images_per_sec")
        first = median_of(runs, contender.name, "first_step_s")
        share = flops_column(rate, gflop, contender.nproc or setup.nproc, peak)
        print(
            f"{contender.label:<44}{fmt(rate):>10}{spread(runs, contender.name):>12}"
            f"{fmt(first, 2):>12}{median_memory(runs, contender.name):>19}{share:>13}"
        )
    for ours, theirs in (
        ("ddpcli_synthetic_device", "reference"),
        ("ddpcli_jpeg_device", "reference"),  # the same JPEG files
        ("ddpcli_jpeg_loader", "reference"),
        ("ddpcli_synthetic_device", "minimal_loop"),
    ):
        ours_rate = median_of(runs, ours, "images_per_sec")
        their_rate = median_of(runs, theirs, "images_per_sec")
        if ours_rate and their_rate:
            print(f"{ours} / {theirs}: {ours_rate / their_rate:.2f}x (medians)")


def flops_column(rate: float | None, gflop: float, gpus: int, peak: float | None) -> str:
    if not rate:
        return "-"
    if peak:
        return fmt(100 * mfu(rate, gflop, gpus, peak), 2)
    return fmt(tflops_per_gpu(rate, gflop, gpus), 4)


def print_mfu(runs, contenders, setup: Setup, measured: dict, peak: float | None) -> None:
    if not contenders:
        return
    arch, size, batch = MFU_MODEL
    gflop = measured["mfu_gflop_per_image"]
    print(
        f"\n1b. MFU at a compute-bound size: {arch}, {size} px, per-process batch {batch}, "
        f"{setup.nproc} GPU(s), {setup.precision}; {gflop:.2f} GFLOP per training image; "
        f"peak {fmt(peak, 0)} TFLOP/s dense bf16 per GPU"
    )
    print(f"{'contender':<44}{'img/s':>10}{'TFLOP/s/GPU':>13}{'MFU %':>8}")
    for contender in contenders:
        rate = median_of(runs, contender.name, "images_per_sec")
        achieved = tflops_per_gpu(rate, gflop, setup.nproc) if rate else None
        share = fmt(100 * mfu(rate, gflop, setup.nproc, peak), 1) if rate and peak else "-"
        print(f"{contender.label:<44}{fmt(rate):>10}{fmt(achieved):>13}{share:>8}")


def print_data_paths(runs, setup: Setup, measured: dict) -> None:
    print(
        f"\n2. data path alone, rank 0 of {setup.nproc}, batch {setup.batch}, "
        f"{setup.workers} worker(s) where it has workers; against training img/s per rank"
    )
    print(f"{'data path':<44}{'img/s alone':>12}{'training/rank':>15}{'headroom':>10}")
    labels = {
        "ddpcli_synthetic_device": "ddpcli device path (uint8 on device)",
        "ddpcli_jpeg_loader": "ddpcli loader path (JPEG, workers)",
        "reference": "reference recipe (JPEG, PIL, workers)",
    }
    for name, label in labels.items():
        alone = measured["data_paths"].get(name)
        training = median_of(runs, name, "images_per_sec")
        per_rank = training / setup.nproc if training else None
        headroom = f"{alone / per_rank:.1f}x" if alone and per_rank else "-"
        print(f"{label:<44}{fmt(alone):>12}{fmt(per_rank):>15}{headroom:>10}")


def print_scaling(runs, setup: Setup, contenders) -> None:
    rates = {setup.nproc: median_of(runs, "ddpcli_synthetic_device", "images_per_sec")}
    for contender in contenders:
        rates[contender.nproc] = median_of(runs, contender.name, "images_per_sec")
    what = "rank(s) on the CPU" if setup.cpu else "GPU(s)"
    print(f"\n3. scaling: ddpcli, synthetic set, device path, batch {setup.batch} per {what}")
    print(f"{'ranks':<8}{'img/s':>10}{'per rank':>10}{'efficiency':>12}")
    single = rates.get(1)
    for count in sorted(rates):
        rate = rates[count]
        efficiency = f"{100 * rate / (count * single):.0f}%" if rate and single else "-"
        per = rate / count if rate else None
        print(f"{count:<8}{fmt(rate):>10}{fmt(per):>10}{efficiency:>12}")


def print_strategies(runs, contenders, gpus: int) -> None:
    print("\n4. strategies: same global batch on every GPU")
    if not contenders:
        print(f"   skipped: dp and balanced-dp need 2 or more GPUs (this run has {gpus})")
        return
    print(f"{'strategy':<44}{'img/s':>10}{'peak GPU MB per GPU':>24}")
    for contender in contenders:
        rate = median_of(runs, contender.name, "images_per_sec")
        print(f"{contender.label:<44}{fmt(rate):>10}{median_memory(runs, contender.name):>24}")


def print_decode(measured: dict) -> None:
    print("\n5. JPEG decoding, ms per image, one thread (lower is faster)")
    for name, ms in measured["decode_ms"].items():
        print(f"   {name:<36}{ms:8.3f}")


def machine_line(measured: dict) -> str:
    import torch

    cores = cpu_cores()
    gpu = "" if measured["device_name"] == cpu_model() else f"{measured['device_name']}; "
    return (
        f"{gpu}{cpu_model()}, {cores} cores; torch {torch.__version__}; "
        f"python {platform.python_version()}; {time.strftime('%Y-%m-%d')}"
    )


# --- Main -----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="Gloo on the CPU, tiny defaults")
    parser.add_argument("--arch", help="default resnet18 (GPU and CPU)")
    parser.add_argument("--image-size", type=int, help="default 96 on GPUs, 32 on the CPU")
    parser.add_argument("--batch", type=int, help="per process; default 128 GPU, 32 CPU")
    parser.add_argument("--steps", type=int, help="timed steps; default 50 GPU, 10 CPU")
    parser.add_argument("--nproc", type=int, help="ranks of table 1; default 1 GPU, 2 CPU")
    parser.add_argument("--max-nproc", type=int, help="scaling up to; default all GPUs / 2")
    parser.add_argument("--workers", type=int, help="DataLoader workers per rank")
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds")
    parser.add_argument("--data-dir", type=Path, help="adds STL-10 if it holds stl10_binary/")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak")
    parser.add_argument("--no-scaling", action="store_true")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--measure-in-process", nargs=3, metavar=("SETUP", "JPEG", "OUT"),
                        help=argparse.SUPPRESS)  # fmt: skip
    return parser.parse_args()


def resolve_setup(args: argparse.Namespace) -> tuple[Setup, int]:
    import torch  # only to count GPUs and ask for bf16; no CUDA context is created

    gpus = 0 if args.cpu else torch.cuda.device_count()
    cpu = gpus == 0
    cores = cpu_cores()
    nproc = args.nproc or (2 if cpu else 1)
    max_nproc = args.max_nproc or (2 if cpu else gpus)
    precision = args.precision or ("fp32" if cpu else "bf16")
    setup = Setup(
        cpu=cpu,
        arch=args.arch or "resnet18",
        image_size=args.image_size or (32 if cpu else 96),
        batch=args.batch or (32 if cpu else 128),
        steps=args.steps or (10 if cpu else 50),
        nproc=nproc,
        max_nproc=max(max_nproc, nproc),
        workers=args.workers if args.workers is not None else max(1, cores // nproc - 1),
        precision=precision,
        threads=max(1, cores // nproc) if cpu else max(1, cores // max(1, max_nproc)),
    )
    return setup, gpus


def measure_child(setup: Setup, jpeg_dir: Path, scratch: Path, timeout_s: float) -> dict:
    out = scratch / "measured.json"
    setup_file = scratch / "setup.json"
    setup_file.write_text(json.dumps(asdict(setup)))
    argv = [sys.executable, __file__, "--measure-in-process", str(setup_file), str(jpeg_dir),
            str(out)]  # fmt: skip
    code, _ = run_bounded(argv, clean_environment(setup), ROOT, scratch / "measure.log", timeout_s)
    if code != 0:
        tail = (scratch / "measure.log").read_text(errors="replace").strip().splitlines()[-6:]
        sys.exit("in-process measurements failed:\n" + "\n".join(tail))
    return json.loads(out.read_text())


def main() -> None:
    args = parse_args()
    if args.measure_in_process:
        setup_file, jpeg_dir, out = (Path(value) for value in args.measure_in_process)
        measure_in_process(Setup(**json.loads(setup_file.read_text())), jpeg_dir, out)
        return
    setup, gpus = resolve_setup(args)
    stl10 = args.data_dir if args.data_dir and (args.data_dir / "stl10_binary").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        scratch = Path(tmp)
        jpeg_dir = scratch / "jpeg"
        count = setup.max_nproc * setup.batch * setup.total_steps
        print(f"writing {count} JPEGs of {setup.image_size} px to a scratch folder", flush=True)
        write_jpeg_folder(jpeg_dir, count, setup.image_size)
        measured = measure_child(setup, jpeg_dir, scratch, args.timeout)
        peak = args.peak_tflops or (None if setup.cpu else peak_tflops(measured["device_name"]))
        print(f"machine: {machine_line(measured)}; load {os.getloadavg()[0]:.2f}", flush=True)
        compared = comparison_contenders(setup, jpeg_dir, stl10)
        mfu_models = mfu_contenders(setup)
        scaling = [] if args.no_scaling else scaling_contenders(setup)
        strategies = strategy_contenders(setup, gpus)
        runs: list[Run] = []
        for round_ in range(1, args.rounds + 1):
            for contender in compared + mfu_models + scaling + strategies:
                run = run_contender(contender, setup, round_, args.timeout)
                runs.append(run)
                status = run.error or f"{run.images_per_sec:.1f} img/s"
                print(f"round {round_}/{args.rounds} {contender.name:<26} {status}", flush=True)
    print(f"load {os.getloadavg()[0]:.2f} at the end")
    print_comparison(runs, compared, setup, measured, peak)
    print_mfu(runs, mfu_models, setup, measured, peak)
    print_data_paths(runs, setup, measured)
    if not args.no_scaling:
        print_scaling(runs, setup, scaling)
    print_strategies(runs, strategies, gpus)
    print_decode(measured)
    if args.json:
        document = {"setup": asdict(setup), "measured": measured, "peak_tflops": peak,
                    "runs": [asdict(run) for run in runs]}  # fmt: skip
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    if any(run.error for run in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
