"""What does `--grad-compression` cost in accuracy? Each compression against none at the same
schedule, on the digits folder of imagefolder_parity.py (1,437 train / 360 val real scans),
trained as that benchmark trains it: `ddpcli train`, resnet18, 2 Gloo ranks x 32, every other
flag the default (so bf16 autocast on a CPU that has it), here at 32 px for 10 epochs.

PowerSGD runs with `--powersgd-start-step` at a tenth of the run's steps (torch's suggestion;
22 of 220 here, the warm-up's length): the default 1000 is longer than this run, which would
then never compress. The table gives each seed's final validation accuracy, the mean +- sd
over the seeds, and each compression's paired difference against none (same seed: same
initial weights and data order) with its 95 % t interval, in points.

    pip install -e ".[bench]"
    python benchmarks/compression_accuracy.py [--seeds 0,1,2] [--only none,bf16,powersgd:2]
        [--root DIR]   # keeps the runs: a rerun reads finished ones instead of training

Each run takes minutes on 2 CPU cores (18 in all); the runs go seed by seed, so an
interrupted sweep still pairs what it finished.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from imagefolder_parity import export_digits, run_ddpcli  # noqa: E402  (a sibling script)

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd:1", "powersgd:2", "powersgd:4")
GLOBAL_BATCH = 64  # run_ddpcli's 2 ranks x 32


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--only", default=",".join(COMPRESSIONS), help="compressions to run")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument(
        "--start-fraction", type=float, default=0.1, help="PowerSGD's start step / the steps"
    )
    parser.add_argument("--root", type=Path, help="keep the folder and runs here")
    return parser.parse_args()


def powersgd_start_step(data: Path, args: argparse.Namespace) -> int:
    """A fraction of the run's optimizer steps (the last partial batch is dropped)."""
    train_images = sum(1 for _ in (data / "train").glob("*/*.png"))
    return round(args.start_fraction * args.epochs * (train_images // GLOBAL_BATCH))


def accuracy(data: Path, compression: str, seed: int, args: argparse.Namespace) -> float:
    """The run's final validation accuracy, read back if ROOT already holds it."""
    out = data.parent / "runs" / f"{compression.replace(':', '-')}-seed{seed}"
    result_file = out / "result.json"
    if result_file.is_file():
        return json.loads(result_file.read_text())["val_acc"]
    flags = ["--grad-compression", compression]
    if compression.startswith("powersgd"):
        flags += ["--powersgd-start-step", str(powersgd_start_step(data, args))]
    try:
        result = run_ddpcli(data, args.size, args.epochs, seed, out, flags)
    except subprocess.CalledProcessError as failure:
        sys.exit(f"{compression} seed {seed} failed:\n{failure.stderr[-2000:]}")
    result_file.write_text(json.dumps(result) + "\n")
    print(f"{compression:<11} seed {seed}: {result['val_acc']:.4f} "
          f"({result['seconds']:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
    return result["val_acc"]


def paired_difference(values: list[float], baseline: list[float]) -> str:
    """The mean paired difference in points with its 95 % t interval."""
    gaps = [100 * (value - base) for value, base in zip(values, baseline, strict=False)]
    if len(gaps) < 2:
        return f"{statistics.fmean(gaps):+.2f} (one seed)" if gaps else ""
    from scipy.stats import t

    half = t.ppf(0.975, len(gaps) - 1) * statistics.stdev(gaps) / math.sqrt(len(gaps))
    mean = statistics.fmean(gaps)
    return f"{mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}]"


def table(results: dict[str, list[float]], seeds: list[int]) -> str:
    head = "| compression | " + " | ".join(f"seed {seed}" for seed in seeds)
    lines = [head + " | mean ± sd | vs none, points [paired 95 %] |"]
    lines.append("|---" * (len(seeds) + 3) + "|")
    for compression, values in results.items():
        cells = [f"{100 * value:.2f}" for value in values] + [""] * (len(seeds) - len(values))
        spread = 100 * statistics.stdev(values) if len(values) > 1 else 0.0
        against = "" if compression == "none" else paired_difference(values, results["none"])
        summary = f"{100 * statistics.fmean(values):.2f} ± {spread:.2f}"
        lines.append(f"| `{compression}` | " + " | ".join(cells) + f" | {summary} | {against} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    compressions = ["none", *(c for c in args.only.split(",") if c != "none")]
    with tempfile.TemporaryDirectory() as tmp:
        data = (args.root or Path(tmp)) / "digits"
        if not (data / "train").is_dir():
            export_digits(data)
        print(f"PowerSGD: --powersgd-start-step {powersgd_start_step(data, args)}",
              file=sys.stderr, flush=True)  # fmt: skip
        results: dict[str, list[float]] = {compression: [] for compression in compressions}
        for seed in seeds:
            for compression in compressions:
                results[compression].append(accuracy(data, compression, seed, args))
    print(f"val accuracy, %: resnet18, digits at {args.size} px, {args.epochs} epochs, "
          f"2 Gloo ranks x 32")  # fmt: skip
    print(table(results, seeds))


if __name__ == "__main__":
    main()
