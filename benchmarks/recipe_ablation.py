"""Does each ingredient of the modern recipe help at a short schedule? With and without
each one, three seeds, on the real image folder of the parity benchmark (scikit-learn's
handwritten digits exported as 64 px PNGs in the ImageNet layout; nothing is downloaded).

Every run is `ddpcli train --dataset imagefolder` at 2 CPU ranks with resnet18 (or --arch);
the baseline is ddpcli's defaults (random-resized crop and flip, label smoothing 0), and
each row adds one ingredient to it, then all of them together. The table gives the final
validation accuracy (mean and spread over the seeds; with --ema, the EMA weights' too), its
change against the baseline, and the training images per second of the run (the input-path
and step cost of the ingredient, side by side: all rows run on the same machine).

Needs a quiet machine: the img/s column is only comparable within one run of this script.

    pip install -e ".[bench]"
    python benchmarks/recipe_ablation.py [--epochs 10] [--seeds 0,1,2] [--size 32]
        [--data-path loader|device] [--only mixup-cutmix,ema] [--stl10 DATA_DIR | --stl10-layout]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from imagefolder_parity import export_digits  # noqa: E402  (a sibling script)

# One row per ingredient: the flags that switch it on, at the v2 recipe's values (ra-reps 2:
# the world here has two ranks).
INGREDIENTS: dict[str, list[str]] = {
    "baseline": [],
    "label-smoothing": ["--label-smoothing", "0.1"],
    "mixup-cutmix": ["--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"],
    "ta_wide": ["--auto-augment", "ta_wide"],
    "randaugment": ["--auto-augment", "randaugment"],
    "random-erase": ["--random-erase", "0.1"],
    # The v2 recipe's 0.99998 is made for 600 epochs: adjusted to this run, its average
    # would hardly leave the warm-up's weights (ddpcli warns); 0.999 gives it a half-life of
    # about 27 of its 49 updates here.
    "ema": ["--ema", "--ema-steps", "4", "--ema-decay", "0.999"],
    "ra-reps": ["--ra-reps", "2"],
    "sync-bn": ["--sync-bn"],
    # ddpcli never decays norm layers by default (the v2 recipe's 0); this row decays them at
    # the default --weight-decay, the first recipe's practice.
    "norm-weight-decay": ["--norm-weight-decay", "5e-4"],
    "fixres": ["--train-crop-size", "{small}"],
    # A check on the row above, not an ingredient: train and validate at the small size
    # (the validation resize follows the crop). Close to the baseline, the small crop itself
    # works, and what the row above loses is the change of resolution.
    "fixres-matched": ["--train-crop-size", "{small}", "--val-crop-size", "{small}"],
}
ALL = [
    flag
    for name, flags in INGREDIENTS.items()
    if name not in ("randaugment", "norm-weight-decay", "fixres-matched")
    for flag in flags
]
# The same without the FixRes crop: what the regularisers lose together at one resolution.
ALL_BUT_FIXRES = [
    flag
    for name, flags in INGREDIENTS.items()
    if name not in ("randaugment", "norm-weight-decay", "fixres-matched", "fixres")
    for flag in flags
]


def run_ddpcli(data: Path, flags: list[str], args: argparse.Namespace, seed: int, out: Path):
    dataset = ["--dataset", "stl10", "--data-dir", str(args.stl10)] if args.stl10 else [
        "--dataset", "imagefolder", "--data-dir", str(data)]  # fmt: skip
    command = [
        sys.executable, "-m", "ddpcli", "train", "--cpu", "--nproc", "2", *dataset,
        "--arch", args.arch, "--image-size",
        str(args.size), "--epochs", str(args.epochs), "--per-gpu-batch", "32", "--seed",
        str(seed), "--data-path", args.data_path, "--out", str(out), "--json", *flags,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=7200)
    if result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n{result.stderr[-2000:]}")
    return json.loads(result.stdout)


def write_stl10_layout(folder_root: Path, binary: Path) -> None:
    """The image folder's train/ and val/ as STL-10's train_X.bin / test_X.bin: 96 px,
    uint8, channel-major, each channel column-major; labels 1..10 in *_y.bin."""
    import numpy as np
    from PIL import Image

    binary.mkdir(parents=True)
    for split, name in (("train", "train"), ("val", "test")):
        files = sorted((folder_root / split).glob("*/*.png"))
        images = np.stack(
            [np.asarray(Image.open(path).convert("RGB").resize((96, 96))) for path in files]
        )  # N, H, W, C
        labels = np.array([int(path.parent.name) + 1 for path in files], dtype=np.uint8)
        images.transpose(0, 3, 2, 1).tofile(binary / f"{name}_X.bin")  # N, C, W, H
        labels.tofile(binary / f"{name}_y.bin")


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    deviation = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * mean:.2f} ± {100 * deviation:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--data-path", default="loader", choices=("loader", "device"))
    parser.add_argument("--only", default="", help="comma-separated rows (baseline is kept)")
    parser.add_argument(
        "--stl10", type=Path, help="train on STL-10 (stl10_binary/ under this folder) instead"
    )
    parser.add_argument(
        "--stl10-layout",
        action="store_true",
        help="train on the same digits written in STL-10's binary layout (96 px, the stl10 "
        "path of ddpcli, no download)",
    )
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    small = str(max(8, round(args.size * 176 / 224)))  # the v2 recipe's 176 for 224
    rows = dict(INGREDIENTS, all=ALL, **{"all-but-fixres": ALL_BUT_FIXRES})
    if args.only:
        rows = {name: rows[name] for name in ["baseline", *args.only.split(",")]}
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "digits"
        export_digits(data)
        if args.stl10_layout:
            args.stl10 = Path(scratch) / "digits-stl10"
            write_stl10_layout(data, args.stl10 / "stl10_binary")
        results: dict[str, list[dict]] = {}
        for name, flags in rows.items():
            flags = [flag.replace("{small}", small) for flag in flags]
            if "--train-crop-size" in flags:
                flags = [*flags, "--augment", "rrc"]
            results[name] = [
                run_ddpcli(data, flags, args, seed, Path(scratch) / f"{name}-{seed}")
                for seed in seeds
            ]
            scores = ", ".join(f"{r['val_acc']:.4f}" for r in results[name])
            print(f"done: {name} (val acc {scores})", file=sys.stderr, flush=True)
    base = statistics.fmean(r["val_acc"] for r in results["baseline"])
    source = "digits in STL-10's layout" if args.stl10_layout else "digits folder"
    print(
        f"{'STL-10' if args.stl10 and not args.stl10_layout else source}: {args.arch} at "
        f"{args.size} px, "
        f"{args.epochs} epochs, 2 CPU ranks x 32, "
        f"{args.data_path} path, seeds {args.seeds}\n"
    )
    print("| ingredient | val acc % (mean ± sd) | vs baseline | EMA val acc % | img/s |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in results.items():
        accuracy = [r["val_acc"] for r in runs]
        ema = [r["ema_val_acc"] for r in runs if r.get("ema_val_acc") is not None]
        rate = statistics.fmean(r["images_per_sec"] for r in runs)
        delta = 100 * (statistics.fmean(accuracy) - base)
        print(
            f"| {name} | {spread(accuracy)} | {delta:+.2f} | {spread(ema) if ema else '-'} | "
            f"{rate:.0f} |"
        )


if __name__ == "__main__":
    main()
