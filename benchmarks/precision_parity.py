"""Does bf16 autocast (what `--precision auto` picks on a CPU with native bf16) reach the
validation accuracy of fp32 on a real image folder?

The folder is imagefolder_parity.py's: scikit-learn's handwritten digits (1,797 real
scans, shipped inside the package) as 64 px PNGs in the ImageNet layout (1,437 train /
360 val). For each seed, `ddpcli train` runs twice with the same flags but
`--precision fp32` and `--precision bf16`, one after the other: resnet18, 2 Gloo ranks x 32,
10 epochs, every other setting ddpcli's default. It prints each run's final validation
accuracy (and images correct), the means over the seeds, their difference, and whether
that difference is within the noise: the larger of the fp32 runs' spread over the seeds and
two binomial standard errors of one run's accuracy (sqrt(p (1 - p) / n), n validation
images).

    pip install -e ".[bench]"     # scikit-learn, for the digits
    python benchmarks/precision_parity.py [--seeds 0,1,2] [--size 64] [--epochs 10]

On a CPU without native bf16 (no AVX512_BF16 or AMX: the script says so) bf16 is emulated
and many times slower; the accuracies still compare, the seconds do not.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from imagefolder_parity import export_digits

ROOT = Path(__file__).resolve().parent.parent
PRECISIONS = ("fp32", "bf16")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write every run here")
    return parser.parse_args()


def run_ddpcli(data: Path, args: argparse.Namespace, seed: int, precision: str, out: Path):
    command = [
        sys.executable, "-m", "ddpcli", "train", "--cpu", "--nproc", "2", "--dataset",
        "imagefolder", "--data-dir", str(data), "--arch", args.arch, "--image-size",
        str(args.size), "--epochs", str(args.epochs), "--per-gpu-batch", "32", "--seed",
        str(seed), "--precision", precision, "--out", str(out), "--json",
    ]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=args.timeout, check=False, cwd=ROOT
    )
    if result.returncode != 0:
        sys.exit(f"ddpcli train --precision {precision} --seed {seed} failed:\n{result.stderr}")
    summary = json.loads(result.stdout)
    return {
        "seed": seed,
        "precision": precision,
        "val_acc": summary["val_acc"],
        "val_samples": summary["val_samples"],
        "seconds": time.perf_counter() - started,
    }


def native_bf16_line() -> str:
    sys.path.insert(0, str(ROOT))
    from ddpcli.training.precision import native_cpu_bf16

    feature = native_cpu_bf16()
    if feature:
        return f"this CPU has native bf16 ({feature})"
    return "this CPU has no native bf16: bf16 is emulated here (slow; accuracies still compare)"


def verdict(runs: list[dict]) -> str:
    by = {p: [r["val_acc"] for r in runs if r["precision"] == p] for p in PRECISIONS}
    fp32, bf16 = statistics.fmean(by["fp32"]), statistics.fmean(by["bf16"])
    samples = runs[0]["val_samples"]
    standard_error = math.sqrt(max(fp32 * (1 - fp32), 1e-12) / max(samples, 1))
    noise = max(max(by["fp32"]) - min(by["fp32"]), 2 * standard_error)
    holds = abs(bf16 - fp32) <= noise
    return (
        f"mean val_acc fp32 {fp32:.4f}, bf16 {bf16:.4f}, difference {bf16 - fp32:+.4f}; noise "
        f"{noise:.4f} (fp32 spread over seeds, or 2 standard errors of {samples} images): "
        f"{'holds' if holds else 'FAILS'}"
    )


def main() -> None:
    args = parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    print(native_bf16_line(), flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "digits"
        export_digits(data)
        print(f"{'seed':>4}  {'precision':<9} {'val_acc':>8} {'correct':>9} {'seconds':>8}")
        for seed in seeds:
            for precision in PRECISIONS:
                out = Path(tmp) / f"run-{seed}-{precision}"
                run = run_ddpcli(data, args, seed, precision, out)
                runs.append(run)
                correct = round(run["val_acc"] * run["val_samples"])
                print(
                    f"{seed:>4}  {precision:<9} {run['val_acc']:>8.4f} "
                    f"{correct:>4}/{run['val_samples']:<4} {run['seconds']:>8.1f}",
                    flush=True,
                )
    print(verdict(runs))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "runs": runs}, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
