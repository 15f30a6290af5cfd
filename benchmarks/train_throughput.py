"""Training throughput of `ddpcli train` against the same work done by its peers.

    python benchmarks/train_throughput.py                 # resnet18, 96 px, batch 16, 2 ranks
    python benchmarks/train_throughput.py --quick         # a short smoke run
    python benchmarks/train_throughput.py --repeats 5 --json results.json
    python benchmarks/train_throughput.py --precisions bf16 --no-tiny   # bf16 against bf16

Contenders, each run as its own process tree with a timeout (scripts in benchmarks/peers/):
  ddpcli       `python -m ddpcli train --cpu --nproc N ...`; images/s from metrics.jsonl
  ddp_loop     a hand-written DDP loop in the pytorch/examples style, under torchrun
  lightning    Lightning's Trainer(accelerator="cpu", strategy="ddp"), timed by a callback
  accelerate   HF Accelerate (Accelerator(cpu=True)), under torchrun

Same work for all: the torchvision model with 10 classes, uint8 images in memory, a random
crop (padding 4) and a flip per sample, normalisation, cross-entropy, SGD with momentum,
Gloo on the CPU, the same per-process batch and world size, and the same threads per
process (OMP_NUM_THREADS = cores // nproc, set for every contender). Each times its
optimizer steps after the first 3 and reports images/s summed over ranks (the slowest
rank's time). Contenders run interleaved, one round after another, so a change in machine
load hits all of them alike. Then the whole-process wall time of a tiny run (5 steps at
32 px), the same way.

One throughput table per `--precisions` entry (all three by default):
  fp32     equal settings: ddpcli `--precision fp32` against every peer's default (fp32)
  bf16     equal precision: ddpcli `--precision bf16` against Lightning
           `precision="bf16-mixed"`, Accelerate `mixed_precision="bf16"` and the hand-written
           loop under `torch.autocast("cpu", torch.bfloat16)`
  default  what a new user gets: ddpcli with no precision flag (`auto`: bf16 on a CPU with
           native bf16 for such models, the table says what it chose) against every
           peer's own defaults, which are fp32: the peers' runs of the fp32 table when it
           is measured too, in the same rounds
Each table ends with ddpcli's ratio to the fastest peer (issue 18 asks at least 1.0 at equal
precision and 1.3 against the peers' defaults).

The peers need the optional extra: pip install -e ".[bench]"
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from _bounded import run_bounded
from _machine import cpu_cores, cpu_model

ROOT = Path(__file__).resolve().parent.parent
PEERS = Path(__file__).resolve().parent / "peers"
WARMUP_STEPS = 3  # ddpcli.training.metrics.TIMING_WARMUP_STEPS; the peers use the same
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


@dataclass(frozen=True)
class Work:
    """One measured configuration, identical for every contender."""

    arch: str
    image_size: int
    batch: int
    nproc: int
    steps: int  # timed steps, after WARMUP_STEPS untimed ones
    threads: int
    precision: str = "fp32"  # fp32, bf16, or "default": each contender's own choice

    @property
    def total_steps(self) -> int:
        return WARMUP_STEPS + self.steps


@dataclass
class Contender:
    name: str
    label: str
    needs: str | None  # a module that must be importable, or None
    script: str | None = None  # under benchmarks/peers/
    source: Path = ROOT  # the checkout whose ddpcli runs (first on the path, and the cwd)

    def available(self) -> bool:
        return self.needs is None or importlib.util.find_spec(self.needs) is not None

    def command(self, work: Work, scratch: Path) -> list[str]:
        if self.script is None:
            return [
                sys.executable, "-m", "ddpcli", "train", "--cpu",
                "--nproc", str(work.nproc),
                "--arch", work.arch,
                "--image-size", str(work.image_size),
                "--per-gpu-batch", str(work.batch),
                # Exactly one epoch of total_steps batches per rank.
                "--synthetic-size", str(work.nproc * work.batch * work.total_steps),
                "--epochs", "1",
                "--max-steps", str(work.total_steps),
                "--out", str(scratch / "ddpcli-out"),
                *([] if work.precision == "default" else ["--precision", work.precision]),
            ]  # fmt: skip
        peer_args = [
            "--arch", work.arch,
            "--image-size", str(work.image_size),
            "--batch", str(work.batch),
            "--steps", str(work.steps),
            "--warmup", str(WARMUP_STEPS),
            "--result", str(scratch / "result.json"),
            *(["--precision", "bf16"] if work.precision == "bf16" else []),  # else their default
        ]  # fmt: skip
        script = str(PEERS / self.script)
        if self.name == "lightning":  # Lightning starts its other ranks itself
            return [sys.executable, script, "--devices", str(work.nproc), *peer_args]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        return [*torchrun, "--nproc-per-node", str(work.nproc), script, *peer_args]

    def images_per_sec(self, scratch: Path) -> float:
        if self.script is None:
            lines = (scratch / "ddpcli-out" / "metrics.jsonl").read_text().splitlines()
            return float(json.loads(lines[-1])["images_per_sec"])
        return float(json.loads((scratch / "result.json").read_text())["images_per_sec"])

    def precision_used(self, scratch: Path, work: Work) -> str:
        """What ran: ddpcli's config.json says what `auto` resolved to; the peers' default
        is fp32 (Lightning "32-true", Accelerate "no", plain PyTorch)."""
        if self.script is None:
            config = json.loads((scratch / "ddpcli-out" / "config.json").read_text())
            return str(config["precision"])
        return "bf16" if work.precision == "bf16" else "fp32"


CONTENDERS = [
    Contender("ddpcli", "ddpcli train", None),
    Contender("ddp_loop", "hand-written DDP loop", None, "ddp_loop.py"),
    Contender("lightning", "Lightning Trainer (ddp)", "lightning", "lightning_trainer.py"),
    Contender("accelerate", "torchrun + Accelerate", "accelerate", "accelerate_loop.py"),
]


@dataclass
class Run:
    contender: str
    round: int
    kind: str  # "throughput-fp32", "throughput-bf16", "throughput-default" or "tiny"
    wall_s: float
    load_before: float = 0.0  # 1-minute load average when the run started
    images_per_sec: float | None = None
    precision: str | None = None  # what ran
    error: str | None = None


@dataclass
class Results:
    runs: list[Run] = field(default_factory=list)

    def values(self, contender: str, kind: str, key: str) -> list[float]:
        return [
            getattr(run, key)
            for run in self.runs
            if run.contender == contender and run.kind == kind and run.error is None
        ]


# --- Running one contender ------------------------------------------------------------------


def clean_environment(threads: int, source: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), env.get("PYTHONPATH")]))
    return env


def run_contender(contender: Contender, work: Work, kind: str, round_: int, timeout_s: float):
    with tempfile.TemporaryDirectory(prefix=f"bench-{contender.name}-") as tmp:
        scratch = Path(tmp)
        log = scratch / "output.log"
        env = clean_environment(work.threads, contender.source)
        command = contender.command(work, scratch)
        load = os.getloadavg()[0]
        code, wall_s = run_bounded(command, env, contender.source, log, timeout_s)
        run = Run(contender.name, round_, kind, wall_s, load)
        if code != 0:
            tail = log.read_text(errors="replace").strip().splitlines()[-6:]
            why = "timed out" if code == 124 else f"exit {code}"
            run.error = f"{why}: " + " | ".join(tail)
            return run
        try:
            run.images_per_sec = contender.images_per_sec(scratch)
            run.precision = contender.precision_used(scratch, work)
        except (OSError, ValueError, KeyError, IndexError) as error:
            run.error = f"no result: {error}"
        return run


# --- Reporting ------------------------------------------------------------------------------


def summary(values: list[float], digits: int) -> tuple[str, str]:
    if not values:
        return "-", "-"
    low, high = min(values), max(values)
    return f"{statistics.median(values):.{digits}f}", f"{low:.{digits}f}-{high:.{digits}f}"


TABLE_TITLES = {
    "fp32": "fp32 against the peers' defaults (fp32): equal settings",
    "bf16": "bf16 against each peer's bf16 autocast setting: equal precision",
    "default": "ddpcli's defaults (no precision flag) against the peers' defaults",
}


def peer_kind(precision: str, precisions: list[str]) -> str:
    """The runs a table takes the peers' figures from: the peers' defaults are their fp32
    runs, measured once when both tables are asked for."""
    if precision == "default" and "fp32" in precisions:
        return "throughput-fp32"
    return f"throughput-{precision}"


def runs_for_peers(kind: str, work: Work, precisions: list[str]) -> bool:
    return kind == "tiny" or peer_kind(work.precision, precisions) == kind


def print_throughput_table(
    results: Results, contenders: list[Contender], work: Work, precisions: list[str]
) -> None:
    ours_kind, peers_kind = f"throughput-{work.precision}", peer_kind(work.precision, precisions)
    print(
        f"\nthroughput, {TABLE_TITLES[work.precision]}: {work.arch}, {work.image_size} px, "
        f"per-process batch {work.batch}, {work.nproc} Gloo ranks x {work.threads} thread(s), "
        f"{work.steps} steps timed after {WARMUP_STEPS}"
    )
    # On a shared machine "best" is the run the least disturbed by other work.
    print(
        f"{'contender':<26}{'precision':>10}{'img/s median':>14}{'range':>16}{'best':>8}{'runs':>6}"
    )
    for contender in contenders:
        kind = ours_kind if contender.script is None else peers_kind
        rates = results.values(contender.name, kind, "images_per_sec")
        used = sorted(set(results.values(contender.name, kind, "precision"))) or ["-"]
        median, spread = summary(rates, 1)
        best = f"{max(rates):.1f}" if rates else "-"
        print(
            f"{contender.label:<26}{'/'.join(used):>10}{median:>14}{spread:>16}{best:>8}"
            f"{len(rates):>6}"
        )
    print_ratio(results, contenders, ours_kind, peers_kind)


def print_ratio(
    results: Results, contenders: list[Contender], ours_kind: str, peers_kind: str
) -> None:
    """Each ddpcli against the peer with the best median, and round by round against the
    fastest peer of that round."""
    peer_names = [c.name for c in contenders if c.script is not None]
    peers = {name: results.values(name, peers_kind, "images_per_sec") for name in peer_names}
    peers = {name: rates for name, rates in peers.items() if rates}
    if not peers:
        return
    fastest = max(peers, key=lambda name: statistics.median(peers[name]))
    label = next(c.label for c in contenders if c.name == fastest)
    for ours in (c for c in contenders if c.script is None):
        rates = results.values(ours.name, ours_kind, "images_per_sec")
        if not rates:
            continue
        ratio = statistics.median(rates) / statistics.median(peers[fastest])
        paired = paired_ratios(results, ours.name, list(peers), ours_kind, peers_kind)
        spread = f"; per round {min(paired):.3f}-{max(paired):.3f}" if paired else ""
        print(f"{ours.label} / fastest peer ({label}): {ratio:.3f} (medians{spread})")


def paired_ratios(
    results: Results, ours: str, peers: list[str], ours_kind: str, peers_kind: str
) -> list[float]:
    """Per round: ours / the best of the peers that ran in that round."""
    by_round: dict[int, dict[str, float]] = {}
    for run in results.runs:
        wanted = (run.contender == ours and run.kind == ours_kind) or (
            run.contender in peers and run.kind == peers_kind
        )
        if wanted and run.error is None and run.images_per_sec is not None:
            by_round.setdefault(run.round, {})[run.contender] = run.images_per_sec
    ratios = []
    for rates in by_round.values():
        best = max((rates[name] for name in peers if name in rates), default=None)
        if ours in rates and best:
            ratios.append(rates[ours] / best)
    return ratios


def print_tiny_table(results: Results, contenders: list[Contender], tiny: Work) -> None:
    print(
        f"\ntiny run: {tiny.arch}, {tiny.image_size} px, {tiny.total_steps} steps, "
        f"{tiny.nproc} ranks: whole-process wall time"
    )
    print(f"{'contender':<26}{'s median':>14}{'range':>16}{'runs':>6}")
    for contender in contenders:
        walls = results.values(contender.name, "tiny", "wall_s")
        median, spread = summary(walls, 2)
        print(f"{contender.label:<26}{median:>14}{spread:>16}{len(walls):>6}")


def machine_line() -> str:
    import torch

    return (
        f"{cpu_model()}, {cpu_cores()} cores, torch {torch.__version__}, "
        f"python {platform.python_version()}, {datetime.date.today().isoformat()}"
    )


# --- Main -----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=16, help="per-process batch")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per run")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (world size)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument(
        "--threads",
        type=int,
        help="threads per process of the peers (default cores // nproc); ddpcli always "
        "splits the cores itself",
    )
    parser.add_argument(
        "--precisions",
        default="fp32,bf16,default",
        help="throughput tables to measure, comma-separated: fp32 (equal settings), bf16 "
        "(each peer's bf16 setting), default (no precision flag against the peers' defaults)",
    )
    parser.add_argument("--tiny-image-size", type=int, default=32)
    parser.add_argument("--tiny-steps", type=int, default=2, help="timed steps of the tiny run")
    parser.add_argument("--no-tiny", action="store_true", help="skip the tiny-run wall times")
    parser.add_argument("--no-throughput", action="store_true", help="only the tiny runs")
    parser.add_argument(
        "--contenders",
        default=",".join(c.name for c in CONTENDERS),
        help="comma-separated subset of: " + ", ".join(c.name for c in CONTENDERS),
    )
    parser.add_argument(
        "--ddpcli-src",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="also run the ddpcli of another checkout (A/B a change); repeatable",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write every run here")
    parser.add_argument("--quick", action="store_true", help="smoke run: 5 steps, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 5, 1
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = sorted(set(args.precisions) - set(TABLE_TITLES))
    if unknown or not args.precisions:
        parser.error(f"--precisions: choose from {', '.join(TABLE_TITLES)} (got {unknown})")
    return args


def chosen_contenders(names: str, sources: list[Path]) -> list[Contender]:
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    unknown = sorted(set(wanted) - {c.name for c in CONTENDERS})
    if unknown:
        sys.exit(f"unknown contender(s): {', '.join(unknown)}")
    chosen = []
    for contender in CONTENDERS:
        if contender.name not in wanted:
            continue
        if not contender.available():
            print(
                f"skipping {contender.label}: {contender.needs} is not installed "
                '(pip install -e ".[bench]")',
                file=sys.stderr,
            )
            continue
        chosen.append(contender)
    for index, source in enumerate(sources, start=1):
        source = source.resolve()
        if not (source / "ddpcli" / "__main__.py").is_file():
            sys.exit(f"--ddpcli-src {source}: no ddpcli/__main__.py there")
        label = f"ddpcli ({source.name})"
        chosen.insert(index, Contender(f"ddpcli_src{index}", label, None, None, source))
    return chosen


def main() -> None:
    args = parse_args()
    threads = args.threads or max(1, cpu_cores() // args.nproc)
    works = {
        precision: Work(
            args.arch, args.image_size, args.batch, args.nproc, args.steps, threads, precision
        )
        for precision in args.precisions
    }
    tiny = Work(args.arch, args.tiny_image_size, args.batch, args.nproc, args.tiny_steps, threads)
    contenders = chosen_contenders(args.contenders, args.ddpcli_src)
    kinds = [] if args.no_throughput else [(f"throughput-{p}", w) for p, w in works.items()]
    kinds += [] if args.no_tiny else [("tiny", tiny)]
    print(f"machine: {machine_line()}; load average {os.getloadavg()[0]:.2f} at start", flush=True)
    results = Results()
    for round_ in range(1, args.repeats + 1):
        for kind, kind_work in kinds:
            for contender in contenders:
                if contender.script and not runs_for_peers(kind, kind_work, args.precisions):
                    continue  # the peers' defaults: their fp32 runs, this round
                run = run_contender(contender, kind_work, kind, round_, args.timeout)
                results.runs.append(run)
                report_run(run, args.repeats)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    if not args.no_throughput:
        for work in works.values():
            print_throughput_table(results, contenders, work, args.precisions)
    if not args.no_tiny:
        print_tiny_table(results, contenders, tiny)
    if args.json:
        document = {
            "machine": machine_line(),
            "work": {precision: work.__dict__ for precision, work in works.items()},
            "tiny": tiny.__dict__,
            "runs": [run.__dict__ for run in results.runs],
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    if any(run.error for run in results.runs):
        sys.exit(1)


def report_run(run: Run, rounds: int) -> None:
    where = f"round {run.round}/{rounds} {run.kind:<18} {run.contender:<11}"
    if run.error:
        print(f"{where} FAILED ({run.wall_s:.1f} s): {run.error}", file=sys.stderr, flush=True)
    elif run.kind.startswith("throughput"):
        print(
            f"{where} {run.images_per_sec:7.1f} img/s {run.precision}  ({run.wall_s:.1f} s, "
            f"load {run.load_before:.2f} before)",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(
            f"{where} {run.wall_s:7.2f} s  (load {run.load_before:.2f} before)",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    main()
