"""The first hour on a GPU machine, in one command: every GPU path run and measured.

    bash benchmarks/gpu_check.sh                 # results in gpu-check-<time>/
    bash benchmarks/gpu_check.sh --out DIR       # ... or in DIR

On a machine with GPUs it runs, each step in its own process tree with its own timeout
(about 9 minutes in all): the `gpu`-marked tests, `check-env --probe`, `bench-barrier` on
NCCL with the collectives at four sizes, `train --gpus 0` on each data path and precision,
with `--compile`, a stop and its resume, and `benchmarks/gpu_throughput.py --rounds 1`.
Every log and figure goes into the output folder, with `summary.md`: a markdown table
ready to paste into docs/performance.md, headed by the machine and the commit.

Without a GPU it says so and exits 0 after checking that every command and flag it would
run exists, so that a renamed flag is caught by CI rather than on the GPU machine.
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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from _bounded import run_bounded

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
DDPCLI = [PYTHON, "-m", "ddpcli"]
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


@dataclass
class Step:
    """One command of the check: what it runs, how long it may take, what it reports."""

    name: str
    command: list[str]
    timeout_s: float
    figure: Callable[[str], str] = lambda output: ""
    needs: str | None = None  # a step whose success this one builds on
    result: dict = field(default_factory=dict)


def train_figure(output: str) -> str:
    summary = last_json(output)
    if not summary:
        return ""
    return (
        f"{summary.get('images_per_sec') or 0:.0f} img/s, val acc "
        f"{100 * summary.get('val_acc', 0):.2f} %, step {summary.get('step', '?')}, "
        f"data wait {100 * (summary.get('data_wait_frac') or 0):.1f} %"
    )


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


def plan(out: Path, gpus: int) -> list[Step]:
    """Every step, in order: the cheap checks first, so a broken node says so at once."""
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
    ]
    # Each precision on the device path, and the loader path at the default precision.
    for data_path, precision in (
        ("device", "bf16"),
        ("device", "fp16"),
        ("device", "fp32"),
        ("loader", "bf16"),
    ):
        steps.append(
            train_step(
                out,
                f"train {data_path} {precision}",
                ["--data-path", data_path, "--precision", precision, "--max-steps", "40"],
            )
        )
    # The peers' comparison before the slower checks: the budget may not reach them all.
    steps.append(
        Step(
            "gpu_throughput.py --rounds 1",
            [
                PYTHON,
                str(ROOT / "benchmarks" / "gpu_throughput.py"),
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
    steps.append(
        train_step(
            out, "train device bf16 --compile", ["--compile", "--max-steps", "40"], timeout_s=150
        )
    )
    steps.append(train_step(out, "train stop at step 20", ["--max-steps", "20"], run="resume"))
    steps.append(
        train_step(
            out, "train resume to step 40", ["--max-steps", "40", "--resume", "auto"], run="resume"
        )
    )
    steps[-1].needs = steps[-2].name
    return steps


def train_step(
    out: Path, name: str, flags: list[str], run: str | None = None, timeout_s: float = 60
) -> Step:
    folder = out / "runs" / (run or re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"))
    command = [*DDPCLI, "train", "--gpus", "0", *TRAIN_SHAPE, "--out", str(folder), *flags]
    return Step(name, command, timeout_s, train_figure)


def missing_flags(steps: list[Step]) -> list[str]:
    """Each command or flag the plan uses that the installed code does not have."""
    problems = []
    for step in steps:
        known = known_flags(step.command)
        if known is None:
            problems.append(f"{step.name}: {' '.join(step.command[:4])} does not run")
            continue
        used = [arg for arg in step.command if arg.startswith("--")]
        problems += [f"{step.name}: {flag} is not a flag" for flag in used if flag not in known]
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


def known_flags(command: list[str]) -> set[str] | None:
    """The flags a command's --help names (None when the command itself fails)."""
    if command[:3] == DDPCLI:
        return flags_in_help(tuple(command[:4]))
    if command[1:3] == ["-m", "pytest"]:
        return flags_in_help(tuple(command[:3]))
    return flags_in_help(tuple(command[:2]))


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
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
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
        log = out / "logs" / f"{number:02d}-{re.sub(r'[^a-z0-9]+', '-', step.name.lower())}.log"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="folder for logs and figures")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all steps")
    args = parser.parse_args(argv)
    out = (args.out or Path(f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}")).resolve()
    gpus = count_gpus()
    steps = plan(out, gpus)
    problems = missing_flags(steps) + missing_gpu_tests()
    if problems:
        print("gpu_check: the plan uses what this checkout does not have:", file=sys.stderr)
        print("\n".join(f"  {problem}" for problem in problems), file=sys.stderr)
        return 1
    if gpus == 0:
        print(
            f"gpu_check: no GPU on this machine (nvidia-smi lists none); the {len(steps)} "
            "steps' commands and flags all exist. Nothing measured.",
            file=sys.stderr,
        )
        return 0
    (out / "logs").mkdir(parents=True, exist_ok=True)
    run_steps(steps, out, args.budget)
    table = summary_table(steps, out, machine_line())
    (out / "summary.md").write_text(table)
    print(table)
    print(f"gpu_check: logs and figures in {out}; summary.md is the table above.", file=sys.stderr)
    return 0 if all(step.result.get("status") == "ok" for step in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
