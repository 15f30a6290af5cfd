"""What torch's flight recorder costs a training step (issue 49): on, as `ddpcli train` runs
every rank by default (`TORCH_FR_BUFFER_SIZE=2000`), against `--no-flight-recorder`.

    python benchmarks/flight_recorder.py                  # micro-benchmark, then end to end
    python benchmarks/flight_recorder.py --micro          # only the all_reduce micro-benchmark
    python benchmarks/flight_recorder.py --no-micro --pairs 6
    python benchmarks/flight_recorder.py --gpu            # NCCL: --gpus 0 (and 0,1 with two GPUs)

Two parts:
  micro       2 ranks (torch.multiprocessing spawn, 127.0.0.1) time all_reduce of a small
              and a larger tensor, thousands of times, with the recorder on and off: the
              microseconds it adds to one collective. The variable is set before the ranks
              start (the recorder reads it once per process), so each mode is its own spawn;
              the modes alternate over rounds (on, off, off, on, ...).
  end to end  `ddpcli train --cpu --nproc 2 --arch resnet18 --image-size 64 --per-gpu-batch 16`
              for one epoch of --steps steps, with and without `--no-flight-recorder`, in
              pairs whose order alternates (ABBA...), each run bounded in time and in a fresh
              --out. The step time of each interval of steps.jsonl after the first
              --drop-steps (warm-up) is global batch / images_per_sec; a run's figure is the
              median over its intervals. The cost is on / off - 1 per pair: its median and
              range. One more, untimed run with the recorder on asks the ranks for their
              record mid-run (the launcher's dump-request file) and counts the collectives
              of a step from it.

Figures only; nothing here asserts speed. Another load on the machine shows as spread: the
interleaving and the medians are there to keep it out of the difference.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from _bounded import run_bounded
from _machine import cpu_cores, cpu_model

ROOT = Path(__file__).resolve().parent.parent
ON_ENTRIES = "2000"  # ddpcli.collectives.record.BUFFER_ENTRIES
LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCH_FR_BUFFER_SIZE",
)  # fmt: skip
MODES = ("on", "off")


# --- The micro-benchmark: one collective ----------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def micro_rank(rank: int, args: argparse.Namespace, port: int, result: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(
        args.backend, rank=rank, world_size=args.micro_ranks, timeout=datetime.timedelta(seconds=60)
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    figures: dict[str, dict[str, list[float]]] = {"wall": {}, "cpu": {}}
    for size in args.sizes:
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
        for _ in range(args.micro_warmup):
            dist.all_reduce(tensor)
        sync()
        for _ in range(args.micro_blocks):
            dist.barrier()
            started, cpu_started = time.perf_counter(), time.process_time()
            for _ in range(args.micro_iters):
                dist.all_reduce(tensor)
            sync()
            # Wall time per call, and this process's CPU time per call (all its threads,
            # Gloo's included): the recorder's work is CPU work, which waiting hides less.
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            figures["wall"].setdefault(str(size), []).append(wall / args.micro_iters * 1e6)
            figures["cpu"].setdefault(str(size), []).append(cpu / args.micro_iters * 1e6)
    entries = recorded_entries()
    if rank == 0:
        Path(result).write_text(json.dumps({"us_per_call": figures, "recorded": entries}))
    dist.barrier()
    dist.destroy_process_group()


def recorded_entries() -> int:
    """How many collectives this process's recorder holds (0 when it is off)."""
    from torch._C import _distributed_c10d

    try:
        raw = getattr(_distributed_c10d, "_dump_fr_trace")(True, False, False)  # noqa: B009
    except (RuntimeError, AttributeError):
        return 0
    return len(pickle.loads(raw).get("entries") or [])


def micro_once(args: argparse.Namespace, mode: str) -> dict:
    """One spawn of 2 ranks with the recorder ON or OFF, bounded by --micro-timeout."""
    with tempfile.TemporaryDirectory(prefix="bench-fr-micro-") as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--micro-child", str(result)]
        command += ["--backend", args.backend, "--sizes", ",".join(map(str, args.sizes))]
        command += ["--micro-ranks", str(args.micro_ranks)]
        command += ["--micro-iters", str(args.micro_iters), "--micro-blocks"]
        command += [str(args.micro_blocks), "--micro-warmup", str(args.micro_warmup)]
        env = clean_environment()
        env["TORCH_FR_BUFFER_SIZE"] = ON_ENTRIES if mode == "on" else "0"
        env.setdefault("OMP_NUM_THREADS", "1")
        log = Path(tmp) / "output.log"
        code, wall = run_bounded(command, env, ROOT, log, args.micro_timeout)
        if code != 0 or not result.exists():
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-4:])
            raise SystemExit(f"micro-benchmark ({mode}) failed, exit {code}: {tail}")
        return json.loads(result.read_text())


def micro_child(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    mp.spawn(
        micro_rank, args=(args, free_port(), args.micro_child), nprocs=args.micro_ranks, join=True
    )


def micro(args: argparse.Namespace) -> dict:
    print(
        f"\nmicro: all_reduce, {args.micro_ranks} {args.backend} rank(s) on 127.0.0.1, "
        f"{args.micro_blocks} blocks of {args.micro_iters} calls per size per run, "
        f"{args.micro_rounds} runs per mode (on, off, off, on, ...); "
        "rank 0's wall and process CPU time per call of each block",
        flush=True,
    )
    metrics = ("wall", "cpu")
    # blocks[metric][mode][size]: every block's µs per call; per_run: each run's median
    blocks = {m: {mode: {} for mode in MODES} for m in metrics}
    per_run = {m: {mode: {} for mode in MODES} for m in metrics}
    recorded: dict[str, list[int]] = {mode: [] for mode in MODES}
    for round_ in range(args.micro_rounds):
        order = MODES if round_ % 2 == 0 else MODES[::-1]
        for mode in order:
            figures = micro_once(args, mode)
            recorded[mode].append(figures["recorded"])
            for metric in metrics:
                for size, values in figures["us_per_call"][metric].items():
                    blocks[metric][mode].setdefault(size, []).extend(values)
                    per_run[metric][mode].setdefault(size, []).append(statistics.median(values))
            shown = ", ".join(
                f"{size_label(int(size))} {statistics.median(v):.1f} µs wall "
                f"{statistics.median(figures['us_per_call']['cpu'][size]):.1f} µs CPU"
                for size, v in figures["us_per_call"]["wall"].items()
            )
            print(
                f"  run {round_ + 1} {mode:<3}: {shown} (recorder holds {figures['recorded']})",
                file=sys.stderr,
                flush=True,
            )
    print(
        f"{'size':>8} {'time':<5}{'on µs':>10}{'off µs':>10}{'added µs':>10}{'added %':>9}"
        "  per run, on/off"
    )
    summary: dict = {}
    for size in map(str, args.sizes):
        for metric in metrics:
            on = statistics.median(blocks[metric]["on"][size])
            off = statistics.median(blocks[metric]["off"][size])
            paired = zip(per_run[metric]["on"][size], per_run[metric]["off"][size], strict=True)
            runs = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in paired)
            print(
                f"{size_label(int(size)):>8} {metric:<5}{on:>10.1f}{off:>10.1f}{on - off:>10.1f}"
                f"{100 * (on / off - 1):>+9.1f}  {runs}"
            )
            low_on, low_off = min(blocks[metric]["on"][size]), min(blocks[metric]["off"][size])
            print(
                f"{'':>8} {'':<5}{low_on:>10.1f}{low_off:>10.1f}{low_on - low_off:>10.1f}"
                f"{100 * (low_on / low_off - 1):>+9.1f}  (the fastest blocks)"
            )
            summary.setdefault(size, {})[metric] = {
                "on_us": on, "off_us": off, "runs_on": per_run[metric]["on"][size],
                "runs_off": per_run[metric]["off"][size],
            }  # fmt: skip
    print(
        f"collectives the recorder held at the end, on: {sorted(set(recorded['on']))}, "
        f"off: {sorted(set(recorded['off']))}"
    )
    return {"sizes": summary, "recorded": recorded}


def size_label(size: int) -> str:
    return f"{size // 2**20} MB" if size >= 2**20 else f"{size // 2**10} kB"


# --- End to end: ddpcli train ---------------------------------------------------------------


def clean_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def world_size(placement: list[str]) -> int:
    if placement[0] == "--gpus":
        return len(placement[1].split(","))
    return int(placement[placement.index("--nproc") + 1])


def train_command(args: argparse.Namespace, placement: list[str], mode: str, out: Path):
    world = world_size(placement)
    return [
        sys.executable, "-m", "ddpcli", "train", *placement,
        "--arch", args.arch,
        "--image-size", str(args.image_size),
        "--per-gpu-batch", str(args.batch),
        # Exactly one epoch of --steps steps.
        "--synthetic-size", str(world * args.batch * args.steps),
        "--epochs", "1",
        "--max-steps", str(args.steps),
        "--out", str(out),
        *(["--no-flight-recorder"] if mode == "off" else []),
    ]  # fmt: skip


def step_times_ms(out: Path, global_batch: int, drop_steps: int) -> list[float]:
    """Each steps.jsonl interval after DROP_STEPS: its mean step time."""
    times = []
    previous = 0
    for line in (out / "steps.jsonl").read_text().splitlines():
        row = json.loads(line)
        step, rate = row["step"], row.get("images_per_sec")
        if previous >= drop_steps and rate and step > previous:
            times.append(1000 * global_batch / rate)
        previous = step
    return times


def train_once(
    args: argparse.Namespace, placement: list[str], mode: str, global_batch: int, where: str
) -> tuple[list[float], float, float, str] | None:
    """One bounded run in a fresh --out: its interval step times (ms), wall time, the load
    before it and the precision it ran; None when it failed."""
    with tempfile.TemporaryDirectory(prefix="bench-fr-") as tmp:
        out = Path(tmp) / "out"
        command = train_command(args, placement, mode, out)
        load = os.getloadavg()[0]
        log = Path(tmp) / "output.log"
        code, wall = run_bounded(command, clean_environment(), ROOT, log, args.timeout)
        if code != 0:
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
            why = "timed out" if code == 124 else f"exit {code}"
            print(f"  {where} {mode}: FAILED ({why}): {tail}", file=sys.stderr, flush=True)
            return None
        times = step_times_ms(out, global_batch, args.drop_steps)
        config = json.loads((out / "config.json").read_text())
    if config.get("flight_recorder") != (mode == "on"):
        raise SystemExit(f"{where} {mode}: the run's config has flight_recorder={config}")
    if not times:
        print(f"  {where} {mode}: no interval after the warm-up", file=sys.stderr)
        return None
    return times, wall, load, str(config.get("precision"))


def end_to_end(args: argparse.Namespace, label: str, placement: list[str]) -> dict:
    world = world_size(placement)
    global_batch = world * args.batch
    print(
        f"\nend to end ({label}): `ddpcli train {' '.join(placement)} --arch {args.arch} "
        f"--image-size {args.image_size} --per-gpu-batch {args.batch}`, {args.steps} steps, "
        f"step time from steps.jsonl after step {args.drop_steps}; {args.pairs} pairs, "
        "order alternating",
        flush=True,
    )
    intervals: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    pairs: list[dict[str, list[float]]] = []  # per pair, each mode's interval step times
    precision = set()
    for pair in range(args.pairs):
        order = MODES if pair % 2 == 0 else MODES[::-1]
        figures = {}
        for mode in order:
            measured = None
            for _attempt in range(1 + args.retries):  # a run killed from outside is run again
                measured = train_once(args, placement, mode, global_batch, f"pair {pair + 1}")
                if measured is not None:
                    break
            if measured is None:
                continue
            times, wall, load, used = measured
            precision.add(used)
            figures[mode] = statistics.median(times)
            intervals[mode].append(times)
            print(
                f"  pair {pair + 1} {mode:<3}: {figures[mode]:7.1f} ms/step (median of "
                f"{len(times)} intervals {min(times):.1f}-{max(times):.1f}; run {wall:.0f} s, "
                f"load {load:.2f} before)",
                file=sys.stderr,
                flush=True,
            )
        if len(figures) == 2:
            pairs.append({mode: intervals[mode][-1] for mode in MODES})
    result: dict = {"label": label, "pairs": pairs, "precision": sorted(map(str, precision))}
    result.update(summarize(pairs, result["precision"]))
    if args.count:
        result["collectives"] = count_collectives(args, placement)
    return result


def summarize(pairs: list[dict[str, list[float]]], precision: list[str]) -> dict:
    """Per mode, each run's median interval and its fastest one (the least disturbed by
    other work on the machine); the cost on / off - 1 of each pair by both."""
    result: dict = {}
    print(f"{'mode':<22}{'ms/step median':>16}{'range':>18}{'fastest':>10}{'runs':>6}")
    for mode in MODES:
        medians = [statistics.median(pair[mode]) for pair in pairs]
        fastest = [min(pair[mode]) for pair in pairs]
        if medians:
            name = "recorder on" if mode == "on" else "--no-flight-recorder"
            print(
                f"{name:<22}{statistics.median(medians):>16.1f}"
                f"{f'{min(medians):.1f}-{max(medians):.1f}':>18}"
                f"{statistics.median(fastest):>10.1f}{len(medians):>6}"
            )
        result[mode] = {"run_medians": medians, "run_fastest": fastest}
    for figure, of in (("median", statistics.median), ("fastest", min)):
        costs = [of(pair["on"]) / of(pair["off"]) - 1 for pair in pairs]
        if not costs:
            continue
        print(
            f"cost by each run's {figure} interval (on / off - 1, per pair): median "
            f"{100 * statistics.median(costs):+.2f} %, range {100 * min(costs):+.2f} to "
            f"{100 * max(costs):+.2f} % over {len(costs)} pairs (precision {', '.join(precision)})"
        )
        result[f"cost_{figure}"] = {"median": statistics.median(costs), "pairs": costs}
    return result


def count_collectives(args: argparse.Namespace, placement: list[str]) -> dict | None:
    """One untimed run with the recorder on: once steps.jsonl has a row at step 30 (three
    logging intervals) or later, touch the launcher's dump-request file, copy rank 0's
    record, and count the collectives between two of the loop's logging reductions
    (`reduce_sums`, one per --log-every steps; ddpcli's default, 10)."""
    with tempfile.TemporaryDirectory(prefix="bench-fr-count-") as tmp:
        scratch = Path(tmp)
        (scratch / "tmp").mkdir()
        out = scratch / "out"
        env = clean_environment()
        env["TMPDIR"] = str(scratch / "tmp")  # where the launcher makes its records folder
        command = train_command(args, placement, "on", out)
        with open(scratch / "output.log", "wb") as log:
            process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            record = scratch / "rank_0"
            try:
                deadline = time.monotonic() + args.timeout
                requested = False
                while time.monotonic() < deadline and process.poll() is None:
                    time.sleep(0.2)
                    folders = list((scratch / "tmp").glob("ddpcli-agent-*/records"))
                    if not folders:
                        continue
                    if not requested and logged_step(out) >= max(args.drop_steps, 30):
                        (folders[0] / "dump-request").touch()
                        requested = True
                    if requested and (folders[0] / "rank_0").exists():
                        shutil.copy(folders[0] / "rank_0", record)
                        break
            finally:
                from _bounded import end_session

                end_session(process)
        if not record.exists():
            print("collectives per step: no record came back", file=sys.stderr)
            return None
        return collectives_per_step(pickle.loads(record.read_bytes()))


def logged_step(out: Path) -> int:
    try:
        lines = (out / "steps.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def collectives_per_step(record: dict) -> dict:
    entries = record.get("entries") or []
    logging = [
        index
        for index, entry in enumerate(entries)
        if any(frame.get("name") == "reduce_sums" for frame in entry.get("frames") or [])
    ]
    kinds = Counter(entry.get("profiling_name", "?") for entry in entries)
    result: dict = {"entries": len(entries), "kinds": dict(kinds)}
    if len(logging) >= 2:
        first, second = logging[-2], logging[-1]
        between = entries[first + 1 : second + 1]  # 10 steps, their logging reduction included
        result["between_logging_reductions"] = dict(
            Counter(entry.get("profiling_name", "?") for entry in between)
        )
        result["per_step"] = len(between) / 10
        sizes = [entry.get("input_sizes") for entry in between]
        result["sizes"] = sizes
    print(
        f"collectives: rank 0's record holds {len(entries)} ({dict(kinds)}); between two "
        f"logging reductions (10 steps, one logging reduction): "
        f"{result.get('between_logging_reductions')}, {result.get('per_step')} per step"
    )
    return result


# --- Main -----------------------------------------------------------------------------------


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def machine_line() -> str:
    import torch

    gpus = gpu_count()
    gpu = f", {gpus} x {torch.cuda.get_device_name(0)}" if gpus else ""
    return (
        f"{cpu_model()}, {cpu_cores()} cores{gpu}, torch {torch.__version__}, python "
        f"{platform.python_version()}, {datetime.date.today().isoformat()}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--micro", action="store_true", help="only the micro-benchmark")
    parser.add_argument("--no-micro", action="store_true", help="only end to end")
    parser.add_argument("--gpu", action="store_true", help="NCCL on the GPUs instead of the CPU")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="per-process batch")
    parser.add_argument("--nproc", type=int, default=2, help="CPU ranks")
    parser.add_argument(
        "--steps", type=int, help="steps per run (default 150 on the CPU, 1000 on a GPU)"
    )
    parser.add_argument("--drop-steps", type=int, default=20, help="warm-up steps left out")
    parser.add_argument("--pairs", type=int, default=6, help="on/off pairs, order alternating")
    parser.add_argument("--no-count", dest="count", action="store_false",
                        help="skip the run that counts the collectives of a step")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=300, help="seconds per training run")
    parser.add_argument("--retries", type=int, default=1, help="reruns of a failed run")
    parser.add_argument("--sizes", default="1024,1048576", help="micro: bytes, comma-separated")
    parser.add_argument("--micro-iters", type=int, default=1000, help="calls per block")
    parser.add_argument("--micro-blocks", type=int, default=5)
    parser.add_argument("--micro-rounds", type=int, default=4, help="runs per mode")
    parser.add_argument("--micro-warmup", type=int, default=200)
    parser.add_argument(
        "--micro-ranks",
        default="2,1",
        help="micro: rank counts, comma-separated; 1 rank (Gloo) is the recorder's own cost "
        "per collective with no peer to wait for",
    )
    parser.add_argument("--micro-timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--summarize", type=Path, metavar="JSON", help="print the tables of a --json"
    )
    parser.add_argument("--micro-child", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.micro_child:
        args.micro_ranks = int(args.micro_ranks)
    else:
        args.micro_ranks_list = [int(n) for n in str(args.micro_ranks).split(",") if n.strip()]
    args.sizes = [int(size) for size in str(args.sizes).split(",") if size.strip()]
    if args.steps is None:
        args.steps = 1000 if args.gpu else 150
    if args.backend is None:
        args.backend = "nccl" if args.gpu else "gloo"
    if args.steps <= args.drop_steps + 10:
        parser.error("--steps must leave at least one logging interval after --drop-steps")
    return args


def main() -> None:
    args = parse_args()
    if args.micro_child:
        micro_child(args)
        return
    if args.summarize:
        document = json.loads(args.summarize.read_text())
        for part in document.get("end_to_end", []):
            print(f"\n{part['label']}")
            summarize(part["pairs"], part["precision"])
        return
    print(f"machine: {machine_line()}; load average {os.getloadavg()[0]:.2f} at start", flush=True)
    document: dict = {"machine": machine_line(), "args": {
        k: str(v) for k, v in vars(args).items() if k != "micro_child"}}  # fmt: skip
    placements: list[tuple[str, list[str]]] = [(f"CPU, {args.nproc} Gloo ranks",
                                                ["--cpu", "--nproc", str(args.nproc)])]  # fmt: skip
    if args.gpu:
        gpus = gpu_count()
        if gpus == 0:
            print("--gpu: no GPU here (torch.cuda.is_available() is False); skipped")
            return
        placements = [("GPU 0, NCCL, 1 rank", ["--gpus", "0"])]
        if gpus >= 2:
            placements.append(("GPUs 0,1, NCCL, 2 ranks", ["--gpus", "0,1"]))
    if not args.no_micro:
        if args.backend == "nccl" and gpu_count() < 2:
            print("micro on NCCL needs 2 GPUs; skipped")
        else:
            document["micro"] = {}
            for ranks in args.micro_ranks_list:
                if ranks == 1 and args.backend == "nccl":
                    continue
                args.micro_ranks = ranks
                document["micro"][str(ranks)] = micro(args)
    if not args.micro:
        document["end_to_end"] = [end_to_end(args, *placement) for placement in placements]
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    if args.json:
        args.json.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
