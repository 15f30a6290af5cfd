"""benchmarks/gpu_check.sh: on a machine without a GPU it checks its own plan and exits 0;
a renamed flag is caught here, not on the GPU machine."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, benchmark_module, clean_env

BENCHMARKS = REPO / "benchmarks"


@pytest.fixture(scope="module")
def check():
    with benchmark_module("gpu_check") as module:
        yield module


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a GPU")
def test_without_a_gpu_the_check_says_so_and_exits_0_having_checked_its_commands(tmp_path):
    env = clean_env(PYTHON=sys.executable, PATH="/usr/bin:/bin")  # no nvidia-smi on PATH
    done = subprocess.run(
        ["bash", str(BENCHMARKS / "gpu_check.sh"), "--out", str(tmp_path / "check")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "no GPU on this machine" in done.stderr
    assert "commands and flags all exist" in done.stderr
    assert not (tmp_path / "check").exists()  # nothing measured, nothing written


def test_the_plan_covers_every_gpu_path_the_issue_lists(check):
    steps = check.plan(Path("/tmp/out"), gpus=2)
    names = " / ".join(step.name for step in steps)
    for wanted in ("pytest -m gpu", "check-env --probe", "bench-barrier NCCL, GPUs 0,1",
                   "train device bf16", "train loader bf16", "train device fp32", "--compile",
                   "resume", "gpu_throughput.py"):  # fmt: skip
        assert wanted in names
    resume = next(step for step in steps if "resume" in step.name and "--resume" in step.command)
    assert resume.needs is not None


def test_no_step_runs_past_the_budget_and_a_failed_stop_skips_its_resume(check, tmp_path):
    check.MIN_STEP_S = 0.5
    steps = [
        check.Step("fails", ["false"], 5),
        check.Step("needs the failed one", ["true"], 5, needs="fails"),
        check.Step("sleeps", ["sleep", "30"], 60),
        check.Step("after the budget", ["true"], 5),
    ]
    (tmp_path / "logs").mkdir()
    check.run_steps(steps, tmp_path, budget_s=2)
    results = [(step.result["status"], step.result["figure"]) for step in steps]
    assert results[0][0] == "exit 1"
    assert results[1] == ("not run", "needs 'fails'")
    assert results[2][0].startswith("timed out at")
    assert steps[2].result["seconds"] < 10
    assert results[3] == ("not run", "the budget was spent")


def test_a_flag_the_code_does_not_have_is_reported(check):
    bad = check.Step("train with a renamed flag", [*check.DDPCLI, "train", "--no-such-flag"], 1)
    good = check.Step("train", [*check.DDPCLI, "train", "--gpus", "0", "--compile"], 1)
    problems = check.missing_flags([bad, good])
    assert problems == ["train with a renamed flag: --no-such-flag is not a flag"]


def test_the_summary_is_a_markdown_table_with_each_steps_figure(check, tmp_path):
    step = check.Step("train device bf16", ["true"], 1)
    step.result = {"status": "ok", "seconds": 12.3, "log": tmp_path / "logs" / "01.log",
                   "figure": "5000 img/s"}  # fmt: skip
    table = check.summary_table([step], tmp_path, "1 x NVIDIA H100")
    assert "1 x NVIDIA H100" in table
    assert "| train device bf16 | ok | 12 | 5000 img/s | logs/01.log |" in table


def test_train_figures_are_read_from_the_json_summary(check):
    output = 'world size 1 ...\n{\n  "images_per_sec": 4321.5,\n  "val_acc": 0.5, "step": 40\n}\n'
    assert check.train_figure(output).startswith("4322 img/s, val acc 50.00 %, step 40")
