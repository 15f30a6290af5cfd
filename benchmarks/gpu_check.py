"""The first hour on a GPU machine, in one command: every GPU path run and measured.

    bash benchmarks/gpu_check.sh                 # results in gpu-check-<time>/
    bash benchmarks/gpu_check.sh --out DIR       # ... or in DIR

On a machine with GPUs it runs, each step in its own process tree with its own timeout,
none past the budget (9 minutes): the `gpu`-marked tests, `check-env --probe`,
`bench-barrier` on NCCL with the collectives at four sizes, then issue 51's rows, beside
the minimal hand-written loop (and at resnet50 the torchvision reference pipeline):
- resnet18 at 96 px, batch 128, synthetic data on the device path: eager bf16, and
  `--compile --compile-mode reduce-overhead` (CUDA graphs) at bf16 and at fp32 (TF32);
- resnet50 at 224 px, batch 256, bf16: the device path, eager and with CUDA graphs, and
  from ImageNet-sized JPEG shards on local disk (benchmarks/imagenet_sized.py) with
  `--decode gpu` against `--decode cpu` on every core but one;
then the rows an earlier check measured: `train` at fp32 and fp16, on the loader path,
with `--compile`'s default mode, a stop and its resume, `benchmarks/gpu_throughput.py
--rounds 1`. The order is the priority: a step the budget does not reach says so.

Every log goes into the output folder, with `summary.md`: a markdown table ready to paste
into docs/performance.md, headed by the machine and the commit, then each row's images/s
(from the run's own output), MFU (GFLOP per training image x images/s over the GPU's dense
bf16 peak, the GPU named as torch names it) and issue 51's target, met or not. The JPEGs
and the runs' folders (checkpoints) go to a scratch folder, removed at the end.

Without a GPU it says so and exits 0 after checking that every command and flag it would
run exists, and that `ddpcli train` takes each step's settings (dry, on the CPU), so that a
renamed flag or a new refusal is caught by CI rather than on the GPU machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from _bounded import run_bounded
from _machine import cpu_cores
from gpu_throughput import mfu

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
PYTHON = sys.executable
DDPCLI = [PYTHON, "-m", "ddpcli"]
TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
# The `gpu`-marked tests, four at a time: each is small, most of its time is starting
# processes (one at a time they outran 150 s on an H100 machine; four took 88 s).
GPU_TESTS = [PYTHON, "-m", "pytest", "-q", "-m", "gpu", "-n", "4", "-p", "no:cacheprovider",
             str(ROOT / "tests")]  # fmt: skip
MIN_STEP_S = 10  # a step given less than this could not even start its workers
TRAIN_SHAPE = [
    "--arch",
    "resnet18",
    "--image-size",
    "96",
    "--per-gpu-batch",
    "128",
    "--synthetic-size",
    "8192",
    "--epochs",
    "1",
    "--json",
]
RESNET18 = ("resnet18", 96)
RESNET50 = ("resnet50", 224)
# The batch of NVIDIA's published ResNet-50 figure (DeepLearningExamples, AMP, one A100):
# the earlier check's 64 is too small a step to keep an H100 busy (docs/performance.md).
RESNET50_BATCH = 256
RESNET50_STEPS = 25  # 22 timed after the warm-up: 5,600 images, a few seconds of steps
PEER_WARMUP = 3  # untimed steps, as ddpcli's StepTimer
# Issue 51's baselines: one H100, 2026-11-26 (docs/performance.md, "GPU figures" and "The
# peers on one H100").
RESNET18_EAGER_BF16 = 10_797  # img/s, resnet18 96 px, batch 128, device path
RESNET50_BATCH64 = 2_787  # img/s, resnet50 224 px, batch 64, device path
RESNET50_SHAPE = ["--arch", "resnet50", "--image-size", "224", "--per-gpu-batch",
                  str(RESNET50_BATCH), "--epochs", "1", "--max-steps", str(RESNET50_STEPS),
                  "--precision", "bf16", "--json"]  # fmt: skip
# The rows other rows are set beside, by name.
FLOPS_STEP = "FLOPs per image, the GPU's peak"
EAGER_BF16 = "train device bf16"
MINIMAL_GRAPHS = "minimal loop resnet18 96 reduce-overhead"
DEVICE_RESNET50 = "train resnet50 224 device bf16"
MINIMAL_RESNET50 = "minimal loop resnet50 224"
REFERENCE_RESNET50 = "reference pipeline resnet50 224"
JPEGS = "ImageNet-sized JPEGs, packed"
DECODE_GPU = "train resnet50 224 shards --decode gpu"
DECODE_CPU = "train resnet50 224 shards --decode cpu"


@dataclass(frozen=True)
class Target:
    """What issue 51 asks of a row's images/s: at least MINIMUM, or at least FRACTION of
    the images/s of the row named OF, measured in the same check."""

    text: str
    minimum: float = 0.0
    of: str | None = None
    fraction: float = 1.0

    def verdict(self, rate: float | None, rates: dict[str, float]) -> str:
        if rate is None:
            return "not measured"
        if self.of is None:
            return "met" if rate >= self.minimum else "not met"
        if self.of not in rates:
            return f"not measured ({self.of} has no figure)"
        return "met" if rate >= self.fraction * rates[self.of] else "not met"


@dataclass
class Step:
    """One command of the check: what it runs, how long it may take, what it reports."""

    name: str
    command: list[str]
    timeout_s: float
    figure: Callable[[str], str] = lambda output: ""
    needs: str | None = None  # a step whose success this one builds on
    result: dict = field(default_factory=dict)
    # A throughput row: images/s read from the run's own output, the model (arch, image
    # size) its MFU is counted for, the rows it is set beside, and issue 51's target.
    rate: Callable[[str], float | None] = lambda output: None
    model: tuple[str, int] | None = None
    against: tuple[str, ...] = ()
    target: Target | None = None


def train_figure(output: str) -> str:
    summary = last_json(output)
    if not summary:
        return ""
    figure = (
        f"{summary.get('images_per_sec') or 0:.0f} img/s, val acc "
        f"{100 * summary.get('val_acc', 0):.2f} %, step {summary.get('step', '?')}, "
        f"data wait {100 * (summary.get('data_wait_frac') or 0):.1f} %"
    )
    if "decoded_on_cpu" in summary:  # --decode gpu: the images nvjpeg refused
        figure += f", {summary['decoded_on_cpu']} image(s) decoded on the CPU"
    peaks = summary.get("peak_memory_mb")
    return figure + (f", peak {max(peaks):.0f} MB on the GPU" if peaks else "")


def train_rate(output: str) -> float | None:
    """images/s of ddpcli's own summary: its StepTimer, the steps after the warm-up."""
    return last_json(output).get("images_per_sec")


def peer_rate(result: Path, output: str = "") -> float | None:
    """images/s a peer wrote to its --result file: its own clock, after the warm-up."""
    try:
        return json.loads(result.read_text())["images_per_sec"]
    except (OSError, ValueError, KeyError):
        return None


def peer_figure(result: Path, output: str = "") -> str:
    rate = peer_rate(result)
    if rate is None:
        return last_line(output)
    peaks = json.loads(result.read_text()).get("peak_memory_mb")
    return f"{rate:.0f} img/s" + (f", peak {max(peaks):.0f} MB on the GPU" if peaks else "")


def jpeg_figure(output: str) -> str:
    report = last_json(output)
    if not report:
        return ""
    size, packed = report["kB"], report["pack"]["splits"]
    return (
        f"{report['train_images']:,} + {report['val_images']:,} JPEGs, {report['width']} x "
        f"{report['height']} px, {size['mean']:.0f} kB mean ({size['min']:.0f}-"
        f"{size['max']:.0f}), {packed['train']['shards']} train shard(s); written in "
        f"{report['write_s']:.0f} s, packed in {report['pack_s']:.0f} s"
    )


def flops_figure(output: str) -> str:
    report = last_json(output)
    if not report:
        return ""
    models = ", ".join(
        f"{model.replace(':', ' at ')} px {gflop:.2f}"
        for model, gflop in report["gflop_per_image"].items()
    )
    peak = report.get("peak_tflops")
    peak_text = f"peak {peak:.0f} TFLOP/s dense bf16" if peak else "peak unknown"
    return f"GFLOP per training image: {models}; {report.get('device') or 'no GPU'}, {peak_text}"


def barrier_figure(output: str) -> str:
    report = last_json(output)
    if not report:
        return ""
    latency = report.get("latency_us", {})
    parts = [f"barrier p50 {latency.get('p50', 0):.0f} us, p99 {latency.get('p99', 0):.0f} us"]
    for row in report.get("collectives", []):
        if row["size_bytes"] >= 1 << 26:
            parts.append(
                f"{row['collective']} {row['size_bytes'] >> 20} MB: "
                f"{row['busbw_GBps']:.1f} GB/s bus"
            )
    return "; ".join(parts)


def probe_figure(output: str) -> str:
    report = last_json(output)
    if not report:
        return ""
    counts = report.get("counts", {})
    probes = [c for c in report.get("checks", []) if c.get("section") == "probe"]
    details = "; ".join(f"{c['name']}: {c['detail']}" for c in probes[:4])
    return f"{counts.get('ok', 0)} ok, {counts.get('warn', 0)} warn, " + (
        f"{counts.get('fail', 0)} fail. {details}"
    )


def pytest_figure(output: str) -> str:
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    return lines[-1].strip("= ") if lines else ""


def last_json(output: str) -> dict:
    """The JSON document a `--json` command printed (stdout), ignoring stderr lines."""
    start = output.find("{")
    while start != -1:
        try:
            return json.loads(output[start:])
        except json.JSONDecodeError:
            start = output.find("\n{", start + 1)
            start = start + 1 if start != -1 else -1
    return {}


def plan(out: Path, gpus: int, scratch: Path | None = None) -> list[Step]:
    """Every step, in order: the cheap checks first, so a broken node says so at once, then
    issue 51's rows, then the rows an earlier check measured. The runs' folders and the
    JPEGs go to SCRATCH (default OUT/scratch)."""
    scratch = scratch or out / "scratch"
    all_gpus = ",".join(str(index) for index in range(max(gpus, 1)))
    steps = [
        Step(
            "pytest -m gpu",
            GPU_TESTS,
            150,
            pytest_figure,
        ),
        Step("check-env --probe", [*DDPCLI, "check-env", "--probe", "--json"], 60, probe_figure),
        Step(
            f"bench-barrier NCCL, GPUs {all_gpus}",
            [
                *DDPCLI,
                "bench-barrier",
                "--gpus",
                all_gpus,
                "--iters",
                "200",
                "--collective",
                "all_reduce,all_gather,broadcast",
                "--sizes",
                "4,1M,64M,1G",
                "--json",
            ],
            90,
            barrier_figure,
        ),
        flops_step(),
        *resnet18_rows(scratch),
        *resnet50_rows(out, scratch),
        *earlier_rows(out, scratch),
    ]
    return steps


def flops_step() -> Step:
    models = [arg for arch, size in (RESNET18, RESNET50) for arg in ("--model", f"{arch}:{size}")]
    command = [PYTHON, str(BENCHMARKS / "model_flops.py"), *models]
    return Step(FLOPS_STEP, command, 60, flops_figure)


def resnet18_rows(scratch: Path) -> list[Step]:
    """Issue 51 (a): CUDA graphs against eager bf16, where the step is launch-bound."""
    target = Target(
        f">= {1.5 * RESNET18_EAGER_BF16:,.0f} img/s (1.5x eager bf16's {RESNET18_EAGER_BF16:,} "
        "on 2026-11-26)",
        minimum=1.5 * RESNET18_EAGER_BF16,
    )

    def row(precision: str, *compile_flags: str) -> Step:
        flags = ["--data-path", "device", "--precision", precision, "--max-steps", "40"]
        graphs = bool(compile_flags)
        return train_step(
            scratch,
            f"train device {precision}" + (" --compile-mode reduce-overhead" if graphs else ""),
            [*flags, *compile_flags],
            timeout_s=120 if graphs else 60,
            model=RESNET18,
            against=(EAGER_BF16, MINIMAL_GRAPHS) if graphs else (),
            target=target if graphs else None,
        )

    graphs = ("--compile", "--compile-mode", "reduce-overhead")
    return [row("bf16"), row("bf16", *graphs), row("fp32", *graphs)]


def resnet50_rows(out: Path, scratch: Path) -> list[Step]:
    """Issue 51 (b) and (c): resnet50 at 224 px on the device path, eager and with CUDA
    graphs, and from ImageNet-sized JPEG shards; the peers beside them."""
    faster = Target(
        f">= {1.3 * RESNET50_BATCH64:,.0f} img/s (1.3x the {RESNET50_BATCH64:,} at batch 64 "
        "on 2026-11-26)",
        minimum=1.3 * RESNET50_BATCH64,
    )
    synthetic = ["--data-path", "device", "--synthetic-size",
                 str(RESNET50_BATCH * RESNET50_STEPS)]  # fmt: skip
    peers = (MINIMAL_RESNET50, REFERENCE_RESNET50)
    common = dict(shape=RESNET50_SHAPE, model=RESNET50, target=faster)
    device = train_step(scratch, DEVICE_RESNET50, synthetic, timeout_s=90, against=peers, **common)
    graphs = train_step(
        scratch,
        f"{DEVICE_RESNET50} --compile-mode reduce-overhead",
        [*synthetic, "--compile", "--compile-mode", "reduce-overhead"],
        timeout_s=180,
        against=(DEVICE_RESNET50, *peers),
        **common,
    )
    minimal = peer_step(
        out, MINIMAL_RESNET50, "minimal_ddp_loop.py", RESNET50, RESNET50_BATCH, RESNET50_STEPS, 60
    )
    # Measured once before (docs/performance.md); last, as the budget may not reach it.
    minimal_graphs = peer_step(
        out, MINIMAL_GRAPHS, "minimal_ddp_loop.py", RESNET18, 128, 40, 90,
        ("--compile", "reduce-overhead"),
    )  # fmt: skip
    return [device, *jpeg_rows(out, scratch), minimal, graphs, minimal_graphs]


def jpeg_rows(out: Path, scratch: Path) -> list[Step]:
    """Issue 51 (c): the JPEGs written and packed, then resnet50 trained from the shards
    with `--decode gpu` and `--decode cpu` (the loader's workers on every core but the
    rank's), and the reference pipeline from the folder."""
    data = scratch / "imagenet-sized"
    images = RESNET50_BATCH * (RESNET50_STEPS + PEER_WARMUP)  # enough for every contender
    command = [PYTHON, str(BENCHMARKS / "imagenet_sized.py"), "--out", str(data)]
    make = Step(JPEGS, [*command, "--images", str(images), "--classes", "100"], 120, jpeg_figure)
    workers = str(max(1, cpu_cores() - 1))
    shards = ["--dataset", "shards", "--data-dir", str(data / "shards"), "--workers", workers]
    common = dict(shape=RESNET50_SHAPE, timeout_s=90, model=RESNET50)
    on_gpu = train_step(
        scratch,
        DECODE_GPU,
        [*shards, "--decode", "gpu"],
        against=(DEVICE_RESNET50, DECODE_CPU, REFERENCE_RESNET50),
        target=Target(
            f">= 90 % of {DEVICE_RESNET50} (this check)", of=DEVICE_RESNET50, fraction=0.9
        ),
        **common,
    )
    on_cpu = train_step(
        scratch,
        DECODE_CPU,
        [*shards, "--decode", "cpu"],
        against=(DEVICE_RESNET50, REFERENCE_RESNET50),
        **common,
    )
    reference = peer_step(
        out,
        REFERENCE_RESNET50,
        "reference_pipeline.py",
        RESNET50,
        RESNET50_BATCH,
        RESNET50_STEPS,
        90,
        ("--data-dir", str(data / "folder"), "--workers", workers),
    )
    for step in (on_gpu, on_cpu, reference):
        step.needs = JPEGS
    return [make, on_gpu, on_cpu, reference]


def earlier_rows(out: Path, scratch: Path) -> list[Step]:
    """What the check measured before issue 51: last, so that the budget reaches issue 51's
    rows first; each still runs where the budget allows (`--budget`)."""

    def eager(data_path: str, precision: str) -> Step:
        flags = ["--data-path", data_path, "--precision", precision, "--max-steps", "40"]
        return train_step(scratch, f"train {data_path} {precision}", flags, model=RESNET18)

    stop = train_step(scratch, "train stop at step 20", ["--max-steps", "20"], run="resume")
    resume = train_step(
        scratch, "train resume to step 40", ["--max-steps", "40", "--resume", "auto"], run="resume"
    )
    resume.needs = stop.name
    steps = [eager("device", "fp32"), stop, resume, eager("device", "fp16")]
    steps.append(eager("loader", "bf16"))
    steps.append(
        train_step(
            scratch,
            "train device bf16 --compile",
            ["--compile", "--max-steps", "40"],
            timeout_s=150,
            model=RESNET18,
        )
    )
    steps.append(
        Step(
            "gpu_throughput.py --rounds 1",
            [
                PYTHON,
                str(BENCHMARKS / "gpu_throughput.py"),
                "--rounds",
                "1",
                "--timeout",
                "120",
                "--json",
                str(out / "gpu_throughput.json"),
            ],
            240,
        )
    )
    return steps


def train_step(
    scratch: Path,
    name: str,
    flags: list[str],
    shape: list[str] = TRAIN_SHAPE,
    timeout_s: float = 60,
    model: tuple[str, int] | None = None,
    against: tuple[str, ...] = (),
    target: Target | None = None,
    run: str | None = None,
) -> Step:
    folder = scratch / "runs" / (run or slug(name))
    command = [*DDPCLI, "train", "--gpus", "0", *shape, "--out", str(folder), *flags]
    return Step(name, command, timeout_s, train_figure, rate=train_rate, model=model,
                against=against, target=target)  # fmt: skip


def peer_step(
    out: Path,
    name: str,
    script: str,
    model: tuple[str, int],
    batch: int,
    steps: int,
    timeout_s: float,
    flags: tuple[str, ...] = (),
) -> Step:
    """A peer under torchrun on GPU 0 at bf16: STEPS steps, the first PEER_WARMUP of them
    not timed (as ddpcli's), its figures in OUT/logs/NAME.json."""
    arch, size = model
    result = out / "logs" / f"{slug(name)}.json"
    command = [
        *TORCHRUN, str(BENCHMARKS / "peers" / script), "--arch", arch, "--image-size", str(size),
        "--batch", str(batch), "--steps", str(steps - PEER_WARMUP), "--warmup", str(PEER_WARMUP),
        "--precision", "bf16", "--result", str(result), *flags,
    ]  # fmt: skip
    return Step(
        name,
        command,
        timeout_s,
        functools.partial(peer_figure, result),
        rate=functools.partial(peer_rate, result),
        model=model,
    )


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def missing_flags(steps: list[Step]) -> list[str]:
    """Each command or flag the plan uses that the installed code does not have."""
    problems = []
    for step in steps:
        for head, args in programs(step.command):
            known = flags_in_help(head)
            if known is None:
                problems.append(f"{step.name}: {' '.join(head)} does not run")
                continue
            used = [arg for arg in args if arg.startswith("--")]
            problems += [f"{step.name}: {flag} is not a flag" for flag in used if flag not in known]
    return problems


def refused_settings(steps: list[Step]) -> list[str]:
    """Each `ddpcli train` step whose settings the installed code refuses, found dry on the
    CPU (`--gpus` as `--cpu`, `--dry-run`, in this process): a new refusal is caught here,
    not on the GPU machine. Steps that read data an earlier step writes are left out."""
    from typer.testing import CliRunner

    from ddpcli.cli import app

    problems = []
    for step in steps:
        if step.command[:4] != [*DDPCLI, "train"] or step.needs == JPEGS:
            continue
        args = step.command[3:]
        gpus = args.index("--gpus")
        dry = [*args[:gpus], "--cpu", *args[gpus + 2 :], "--dry-run"]
        result = CliRunner().invoke(app, dry, env={"COLUMNS": "300"})
        if result.exit_code != 0:
            problems.append(f"{step.name}: refused: {last_line(result.stderr)}")
    return problems


def missing_gpu_tests() -> list[str]:
    """The `gpu`-marked tests must exist even where they skip: collect them."""
    collected = subprocess.run(
        [*GPU_TESTS, "--collect-only", "-n", "0"],  # collected once, not by 4 workers
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    if re.search(r"\d+(/\d+)? tests? (collected|selected)", collected.stdout):
        return []
    return [f"pytest -m gpu: no gpu-marked test collected ({last_line(collected.stdout)})"]


def programs(command: list[str]) -> list[tuple[tuple[str, ...], list[str]]]:
    """Each program COMMAND runs, as (what prints its --help, the arguments it reads): a
    ddpcli command, pytest, a script; a peer under torchrun is two, torchrun and the peer."""
    if command[:3] == DDPCLI:
        return [(tuple(command[:4]), command[4:])]
    if command[1:3] == ["-m", "pytest"]:
        return [(tuple(command[:3]), command[3:])]
    if command[:3] == TORCHRUN[:3]:
        script = next(index for index, arg in enumerate(command) if arg.endswith(".py"))
        return [
            (tuple(command[:3]), command[3:script]),
            ((command[0], command[script]), command[script + 1 :]),
        ]
    return [(tuple(command[:2]), command[2:])]


@functools.cache
def flags_in_help(head: tuple[str, ...]) -> set[str] | None:
    env = {**os.environ, "COLUMNS": "300", "TERM": "dumb", "NO_COLOR": "1"}
    shown = subprocess.run(
        [*head, "--help"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    if shown.returncode != 0:
        return None
    return set(re.findall(r"--[a-z][a-z0-9-]*", shown.stdout))


def count_gpus() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return listed.stdout.count("GPU ") if listed.returncode == 0 else 0


def machine_line() -> str:
    query = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    gpus = "; ".join(sorted(set(query.stdout.strip().splitlines()))) or "no GPU"
    versions = subprocess.run(
        [PYTHON, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
        capture_output=True,
        text=True,
    )
    # COMMIT: what the caller says it is, where the checkout travelled without its .git.
    commit = (
        os.environ.get("COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    )
    return (
        f"{count_gpus()} x {gpus}; {os.cpu_count()} CPU cores; torch "
        f"{versions.stdout.strip()}; commit {commit or '?'}"
    )


def run_steps(steps: list[Step], out: Path, budget_s: float) -> None:
    """Each step in turn, none past the budget: a step gets its own timeout or what is
    left of the budget, whichever is shorter, so the whole check ends in time."""
    # The checkout first, then whatever the caller put on the path (carried wheels, say).
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    deadline = time.monotonic() + budget_s
    passed: set[str] = set()
    for number, step in enumerate(steps, 1):
        log = out / "logs" / f"{number:02d}-{slug(step.name)}.log"
        timeout_s = min(step.timeout_s, deadline - time.monotonic())
        if (step.needs and step.needs not in passed) or timeout_s < MIN_STEP_S:
            why = "the budget was spent" if timeout_s < MIN_STEP_S else f"needs {step.needs!r}"
            step.result = {"status": "not run", "seconds": 0.0, "figure": why}
            continue
        print(f"[{number}/{len(steps)}] {step.name} ...", file=sys.stderr, flush=True)
        code, seconds = run_bounded(step.command, env, ROOT, log, timeout_s)
        output = log.read_text(errors="replace")
        status = {0: "ok", 124: f"timed out at {timeout_s:.0f} s"}.get(code, f"exit {code}")
        step.result = {
            "status": status,
            "seconds": seconds,
            "log": log,
            "figure": step.figure(output) if code == 0 else last_line(output),
            "images_per_sec": step.rate(output) if code == 0 else None,
        }
        if code == 0:
            passed.add(step.name)
        print(f"    {status} in {seconds:.0f} s  {step.result['figure']}", file=sys.stderr)


def last_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


def summary_table(steps: list[Step], out: Path, machine: str) -> str:
    rows = [
        f"Measured by `bash benchmarks/gpu_check.sh` on {machine}, {time.strftime('%Y-%m-%d')}.",
        "",
        "| step | status | seconds | figures | log |",
        "|---|---|---|---|---|",
    ]
    for step in steps:
        result = step.result
        log = Path(result["log"]).relative_to(out) if result.get("log") else ""
        figure = str(result.get("figure", "")).replace("|", "/")
        rows.append(
            f"| {step.name} | {result.get('status', 'not run')} | "
            f"{result.get('seconds', 0):.0f} | {figure} | {log} |"
        )
    return "\n".join(rows) + "\n"


def throughput_table(steps: list[Step]) -> str:
    """Each throughput row: images/s, MFU, the rows it is set beside, issue 51's target."""
    flops = model_flops(steps)
    peak, device = flops.get("peak_tflops"), flops.get("device") or "the GPU"
    gflops = flops.get("gflop_per_image", {})
    rates = {step.name: rate for step in steps if (rate := step.result.get("images_per_sec"))}
    rows = [
        "Images/s from each run's own output after its warm-up steps (ddpcli's summary, the "
        "peers' result files); MFU: GFLOP per training image x images/s over the dense bf16 "
        + (f"peak of {device}, {peak:.0f} TFLOP/s." if peak else f"peak of {device}: unknown."),
        "",
        "| row | img/s | GFLOP/image | MFU % | against | target | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for step in steps:
        if step.model is None:
            continue
        rate = rates.get(step.name)
        gflop = gflops.get(f"{step.model[0]}:{step.model[1]}")
        share = f"{100 * mfu(rate, gflop, 1, peak):.1f}" if rate and gflop and peak else "-"
        beside = [other for other in step.against if rate and other in rates]
        against = "; ".join(f"{rate / rates[other]:.2f}x {other}" for other in beside)
        target = step.target.text if step.target else "none: a comparison"
        verdict = step.target.verdict(rate, rates) if step.target else "-"
        rows.append(
            f"| {step.name} | {f'{rate:,.0f}' if rate else step.result.get('status', 'not run')} "
            f"| {f'{gflop:.2f}' if gflop else '-'} | {share} | {against or '-'} | {target} | "
            f"{verdict} |"
        )
    return "\n".join(rows) + "\n"


def model_flops(steps: list[Step]) -> dict:
    """What benchmarks/model_flops.py printed: FLOPs per image, the GPU and its peak."""
    step = next((step for step in steps if step.name == FLOPS_STEP), None)
    if step is None or step.result.get("status") != "ok":
        return {}
    return last_json(Path(step.result["log"]).read_text(errors="replace"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="folder for logs and figures")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all steps")
    parser.add_argument(
        "--scratch", type=Path, help="the JPEGs and the runs' folders, kept (default: a "
        "folder in the system's temp dir, removed at the end: 1-2 GB, checkpoints mostly)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    out = (args.out or Path(f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}")).resolve()
    scratch = (args.scratch or Path(tempfile.gettempdir()) / f"gpu-check-{os.getpid()}").resolve()
    gpus = count_gpus()
    steps = plan(out, gpus, scratch)
    problems = missing_flags(steps) or refused_settings(steps)
    problems += missing_gpu_tests()
    if problems:
        print("gpu_check: the plan uses what this checkout does not have:", file=sys.stderr)
        print("\n".join(f"  {problem}" for problem in problems), file=sys.stderr)
        return 1
    if gpus == 0:
        print(
            f"gpu_check: no GPU on this machine (nvidia-smi lists none); the {len(steps)} "
            "steps' commands and flags all exist, and `train` takes their settings. Nothing "
            "measured.",
            file=sys.stderr,
        )
        return 0
    (out / "logs").mkdir(parents=True, exist_ok=True)
    try:
        run_steps(steps, out, args.budget)
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    table = summary_table(steps, out, machine_line()) + "\n" + throughput_table(steps)
    (out / "summary.md").write_text(table)
    print(table)
    print(f"gpu_check: logs and figures in {out}; summary.md is the table above.", file=sys.stderr)
    return 0 if all(step.result.get("status") == "ok" for step in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
