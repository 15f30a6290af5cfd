"""What `--per-gpu-batch auto` costs a step (issue 50), and what it finds on a GPU.

    python benchmarks/batch_auto.py                  # CPU: auto against the same split by hand
    python benchmarks/batch_auto.py --pairs 6
    python benchmarks/batch_auto.py --gpu            # GPU: the search's finding, its time, img/s

CPU: `ddpcli train --cpu --nproc 2 --arch resnet18 --image-size 64` for --steps steps, with
micro-batches of --micro split by hand (`--per-gpu-batch M --accumulate K`: DDP's own
all-reduce, overlapped with the last backward pass) and by auto at the same split
(`--per-gpu-batch auto --global-batch 2MK`, DDPCLI_FAKE_OOM making the search keep M: the
ranks' agreement and the gradient all-reduce after the backward pass). Pairs alternate
their order; a run's figure is its median step time from steps.jsonl after the warm-up.

GPU (--gpu, on device 0): for resnet50 at 224 px and resnet18 at 96 px, auto's header line
(what it tried, what it kept, what that leaves free), the seconds from the run's start to
its first step against the same run with the kept micro-batch given by hand, and both runs'
img/s; then a run whose rank 0 runs out of memory on purpose at step 5 (DDPCLI_FAKE_OOM),
and the line that says it went on.

Figures only; nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _bounded import run_bounded
from _machine import cpu_cores, cpu_model
from flight_recorder import clean_environment, step_times_ms

ROOT = Path(__file__).resolve().parent.parent
MODES = ("by hand", "auto")


def cpu_command(args: argparse.Namespace, mode: str, out: Path) -> list[str]:
    world, share = 2, args.micro * args.accumulate
    batch = ["--per-gpu-batch", str(args.micro), "--accumulate", str(args.accumulate)]
    if mode == "auto":
        batch = ["--per-gpu-batch", "auto", "--global-batch", str(world * share)]
    return [
        sys.executable, "-m", "ddpcli", "train", "--cpu", "--nproc", str(world),
        "--arch", "resnet18", "--image-size", "64", *batch,
        "--synthetic-size", str(world * share * args.steps), "--epochs", "1",
        "--log-every", "5", "--out", str(out),
    ]  # fmt: skip


def run(command: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, Path, float]:
    """One bounded run in a fresh folder: (exit code, its output, its --out, wall seconds).
    COMMAND's `--out` is replaced by the folder's; the start's Unix time is kept beside it."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-auto-"))
    out = tmp / "out"
    command = [str(out) if arg == "OUT" else arg for arg in command]
    log = tmp / "output.log"
    (tmp / "started").write_text(repr(time.time()))
    code, wall = run_bounded(command, env, ROOT, log, timeout)
    return code, log.read_text(errors="replace"), out, wall


def cpu(args: argparse.Namespace) -> None:
    share = args.micro * args.accumulate
    print(
        f"CPU: {cpu_model()} ({cpu_cores()} cores); resnet18 at 64 px, 2 Gloo ranks, share "
        f"{share} in {args.accumulate} micro-batches of {args.micro}, {args.steps} steps; "
        f"{args.pairs} pairs, order alternating; median step time after step {args.drop_steps}",
        flush=True,
    )
    medians: dict[str, list[float]] = {mode: [] for mode in MODES}
    for pair in range(args.pairs):
        for mode in MODES if pair % 2 == 0 else MODES[::-1]:
            env = clean_environment()
            if mode == "auto":  # the search keeps --micro, as by hand
                env["DDPCLI_FAKE_OOM"] = f"0:forward:{args.micro + 1}"
            code, output, out, wall = run(cpu_command(args, mode, Path("OUT")), env, args.timeout)
            if code != 0:
                print(f"  pair {pair + 1} {mode}: exit {code}: {output[-400:]}", file=sys.stderr)
                continue
            times = step_times_ms(out, 2 * share, args.drop_steps)
            medians[mode].append(statistics.median(times))
            print(
                f"  pair {pair + 1} {mode:<8}: {medians[mode][-1]:7.1f} ms/step (run {wall:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    for mode in MODES:
        if medians[mode]:
            print(
                f"{mode:<8} {statistics.median(medians[mode]):8.1f} ms/step (runs: "
                f"{', '.join(f'{m:.1f}' for m in medians[mode])})"
            )
    pairs = list(zip(medians["auto"], medians["by hand"], strict=False))
    if pairs:
        costs = [auto / hand - 1 for auto, hand in pairs]
        print(
            f"auto / by hand - 1 per pair: median {100 * statistics.median(costs):+.1f} %, "
            f"range {100 * min(costs):+.1f} to {100 * max(costs):+.1f} %"
        )


def gpu(args: argparse.Namespace) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--gpu: no CUDA GPU here")
    print(f"GPU: {torch.cuda.get_device_name(0)}, {torch.__version__}", flush=True)
    for arch, side, global_batch in (("resnet50", 224, 1024), ("resnet18", 96, 4096)):
        common = [
            sys.executable, "-m", "ddpcli", "train", "--gpus", "0", "--arch", arch,
            "--image-size", str(side), "--synthetic-size", str(global_batch * 12),
            "--epochs", "1", "--max-steps", "10", "--log-every", "2", "--out", "OUT",
        ]  # fmt: skip
        auto = [*common, "--per-gpu-batch", "auto", "--global-batch", str(global_batch)]
        code, output, out, wall = run(auto, clean_environment(), args.timeout)
        line = next((x for x in output.splitlines() if x.startswith("per-GPU batch")), "")
        print(f"\n{arch} at {side} px, global batch {global_batch}: exit {code}, {wall:.0f} s")
        print(f"  auto: {line}")
        found = re.match(r"per-GPU batch (\d+)", line)
        if code != 0 or found is None:
            print(output[-1500:])
            continue
        figures = {"auto": first_step_and_rate(out)}
        micro = int(found.group(1))
        if global_batch % micro == 0:
            hand = [
                *common,
                "--per-gpu-batch",
                str(micro),
                "--accumulate",
                str(global_batch // micro),
            ]
            code, output, out, wall = run(hand, clean_environment(), args.timeout)
            figures["by hand"] = first_step_and_rate(out) if code == 0 else None
        for mode, measured in figures.items():
            if measured:
                print(f"  {mode:<8}: first step at {measured[0]:.1f} s, {measured[1]:.0f} img/s")
        env = {**clean_environment(), "DDPCLI_FAKE_OOM": f"0:backward:{micro}:5"}
        code, output, out, wall = run(auto, env, args.timeout)
        said = [x for x in output.splitlines() if "out of memory in the" in x]
        print(f"  a forced out-of-memory at step 6: exit {code}; {said[:1]}")


def first_step_and_rate(out: Path) -> tuple[float, float] | None:
    """(seconds from the command's start to the end of its first step, the epoch's img/s)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    started = float((out.parent / "started").read_text())
    if not rows or "first_step_at" not in rows[0]:
        return None
    return float(rows[0]["first_step_at"]) - started, float(rows[-1]["images_per_sec"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--drop-steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    gpu(args) if args.gpu else cpu(args)


if __name__ == "__main__":
    main()
