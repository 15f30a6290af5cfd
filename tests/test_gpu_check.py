"""benchmarks/gpu_check.sh: on a machine without a GPU it checks its own plan and exits 0;
a renamed flag is caught here, not on the GPU machine."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, benchmark_module, clean_env

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


def flag(step, name: str) -> str:
    """The value STEP's command gives flag NAME."""
    return step.command[step.command.index(name) + 1]


def test_issue_51s_rows_come_before_the_rows_measured_earlier_each_with_its_target(check):
    steps = check.plan(Path("/tmp/out"), gpus=1, scratch=Path("/tmp/scratch"))
    by_name = {step.name: step for step in steps}
    names = list(by_name)
    graphs = [name for name in names if name.endswith("--compile-mode reduce-overhead")]
    assert graphs == ["train device bf16 --compile-mode reduce-overhead",
                      "train device fp32 --compile-mode reduce-overhead",
                      "train resnet50 224 device bf16 --compile-mode reduce-overhead"]  # fmt: skip
    for name in graphs:
        assert flag(by_name[name], "--compile-mode") == "reduce-overhead"
        assert "--compile" in by_name[name].command
    # (a): resnet18 at 96 px, batch 128, set beside eager bf16 and the minimal loop's graphs.
    fp32 = by_name["train device fp32 --compile-mode reduce-overhead"]
    assert (flag(fp32, "--arch"), flag(fp32, "--image-size"), flag(fp32, "--per-gpu-batch")) == (
        "resnet18", "96", "128")  # fmt: skip
    assert fp32.target.minimum == 1.5 * 10_797
    assert fp32.against == ("train device bf16", "minimal loop resnet18 96 reduce-overhead")
    # (b) and (c): resnet50 at 224 px, bf16, the JPEG rows after the data they read.
    device = by_name["train resnet50 224 device bf16"]
    assert (flag(device, "--arch"), flag(device, "--image-size"), flag(device, "--precision"),
            flag(device, "--data-path")) == ("resnet50", "224", "bf16", "device")  # fmt: skip
    assert device.target.minimum == 1.3 * 2_787
    assert set(device.against) == {"minimal loop resnet50 224", "reference pipeline resnet50 224"}
    cores_but_one = str(max(1, check.cpu_cores() - 1))
    for decode in ("gpu", "cpu"):
        row = by_name[f"train resnet50 224 shards --decode {decode}"]
        assert flag(row, "--decode") == decode and flag(row, "--dataset") == "shards"
        assert flag(row, "--workers") == cores_but_one
        assert flag(row, "--data-dir").startswith("/tmp/scratch/")
        assert row.needs == "ImageNet-sized JPEGs, packed"
        assert names.index(row.needs) < names.index(row.name)
    on_gpu = by_name["train resnet50 224 shards --decode gpu"].target
    assert (on_gpu.of, on_gpu.fraction) == ("train resnet50 224 device bf16", 0.9)
    reference = by_name["reference pipeline resnet50 224"]
    assert flag(reference, "--workers") == cores_but_one
    assert reference.needs == "ImageNet-sized JPEGs, packed"
    # Every row with a model has its figure read from the run's output; the earlier rows last.
    assert all(step.rate is not check.Step.rate for step in steps if step.model)
    assert names.index(graphs[-1]) < names.index("train device fp32") < names.index(
        "gpu_throughput.py --rounds 1")  # fmt: skip
    # The runs' folders and the JPEGs go to the scratch folder, not to the output folder.
    for step in steps:
        if "--out" in step.command and step.command[:3] == check.DDPCLI:
            assert flag(step, "--out").startswith("/tmp/scratch/runs/")


def test_a_peer_under_torchrun_is_two_programs_each_checked_for_its_own_flags(check):
    peer = check.BENCHMARKS / "peers" / "minimal_ddp_loop.py"
    command = [*check.TORCHRUN, str(peer), "--compile", "reduce-overhead", "--no-such-flag"]
    assert check.programs(command) == [
        (tuple(check.TORCHRUN[:3]), check.TORCHRUN[3:]),
        ((check.PYTHON, str(peer)), ["--compile", "reduce-overhead", "--no-such-flag"]),
    ]
    jpegs = [check.PYTHON, str(check.BENCHMARKS / "imagenet_sized.py"), "--images", "8",
             "--no-such-size"]  # fmt: skip
    problems = check.missing_flags([check.Step("peer", command, 1), check.Step("data", jpegs, 1)])
    assert problems == ["peer: --no-such-flag is not a flag", "data: --no-such-size is not a flag"]


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
    decoded = '{"images_per_sec": 3000, "decoded_on_cpu": 2, "peak_memory_mb": [900.4, 20000.0]}'
    assert check.train_figure(decoded).endswith(
        ", 2 image(s) decoded on the CPU, peak 20000 MB on the GPU"
    )
    assert check.train_rate(decoded) == 3000


def throughput_steps(check, tmp_path, flops: dict | None) -> list:
    """A few rows as a run on one GPU leaves them, and the FLOPs step's log."""
    log = tmp_path / "04-flops.log"
    log.write_text("some stderr line\n" + json.dumps(flops or {}))
    flops_step = check.Step(check.FLOPS_STEP, ["true"], 1)
    flops_step.result = {"status": "ok" if flops else "exit 1", "log": log}
    device = check.Step("train resnet50 224 device bf16", ["true"], 1, model=("resnet50", 224),
                        target=check.Target("fast", minimum=3623))  # fmt: skip
    on_gpu = check.Step("decode gpu", ["true"], 1, model=("resnet50", 224), against=(device.name,),
                        target=check.Target("90 %", of=device.name, fraction=0.9))  # fmt: skip
    on_cpu = check.Step("decode cpu", ["true"], 1, model=("resnet50", 224),
                        target=check.Target("90 %", of=device.name, fraction=0.9))  # fmt: skip
    skipped = check.Step("graphs", ["true"], 1, model=("resnet50", 224),
                         target=check.Target("fast", minimum=3623))  # fmt: skip
    device.result = {"status": "ok", "images_per_sec": 3700.0}
    on_gpu.result = {"status": "ok", "images_per_sec": 3400.0}
    on_cpu.result = {"status": "ok", "images_per_sec": 2000.0}
    skipped.result = {"status": "not run"}
    return [flops_step, device, on_gpu, on_cpu, skipped]


def test_each_throughput_row_states_its_mfu_and_whether_it_met_its_target(check, tmp_path):
    flops = {"device": "NVIDIA H100 80GB HBM3", "peak_tflops": 989.0,
             "gflop_per_image": {"resnet50:224": 24.52}}  # fmt: skip
    table = check.throughput_table(throughput_steps(check, tmp_path, flops))
    assert "peak of NVIDIA H100 80GB HBM3, 989 TFLOP/s" in table
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()[4:]}
    assert rows["train resnet50 224 device bf16"] == (
        "| train resnet50 224 device bf16 | 3,700 | 24.52 | 9.2 | - | fast | met |")  # fmt: skip
    assert rows["decode gpu"].endswith("| 0.92x train resnet50 224 device bf16 | 90 % | met |")
    assert rows["decode cpu"].endswith("| 90 % | not met |")
    assert rows["graphs"] == "| graphs | not run | 24.52 | - | - | fast | not measured |"


def test_without_the_flops_step_mfu_says_the_peak_is_unknown(check, tmp_path):
    table = check.throughput_table(throughput_steps(check, tmp_path, None))
    assert "peak of the GPU: unknown" in table
    assert "| train resnet50 224 device bf16 | 3,700 | - | - | - | fast | met |" in table


def test_a_target_against_a_row_that_has_no_figure_is_not_measured(check):
    target = check.Target("90 %", of="device", fraction=0.9)
    assert target.verdict(100.0, {}) == "not measured (device has no figure)"
    assert target.verdict(None, {"device": 100.0}) == "not measured"
    assert target.verdict(90.0, {"device": 100.0}) == "met"


def test_model_flops_counts_a_training_image_and_names_no_gpu_here(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "model_flops.py"), "--model", "tinycnn:32"],
        capture_output=True, text=True, env=clean_env(CUDA_VISIBLE_DEVICES=""), timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["device"] is None and report["peak_tflops"] is None
    assert report["gflop_per_image"]["tinycnn:32"] > 0


def test_peers_and_the_jpeg_step_report_from_their_own_output(check, tmp_path):
    result = tmp_path / "peer.json"
    assert check.peer_rate(result) is None  # the peer never wrote it
    result.write_text(json.dumps({"images_per_sec": 1234.5, "peak_memory_mb": [900.0]}))
    assert check.peer_rate(result) == 1234.5
    assert check.peer_figure(result) == "1234 img/s, peak 900 MB on the GPU"
    report = {"train_images": 7168, "val_images": 200, "width": 400, "height": 350,
              "kB": {"mean": 81.7, "min": 55.1, "max": 101.5}, "write_s": 9.2, "pack_s": 12.0,
              "pack": {"splits": {"train": {"shards": 3}}}}  # fmt: skip
    assert check.jpeg_figure("writing ...\n" + json.dumps(report)) == (
        "7,168 + 200 JPEGs, 400 x 350 px, 82 kB mean (55-102), 3 train shard(s); written in "
        "9 s, packed in 12 s"
    )


def test_a_step_whose_settings_train_refuses_is_caught_without_a_gpu(check):
    steps = check.plan(Path("/tmp/out"), gpus=1, scratch=Path("/tmp/scratch"))
    assert check.refused_settings(steps) == []  # every step's settings, dry on the CPU
    eager = next(step for step in steps if step.name == "train device bf16")
    eager.command += ["--workers", "2"]  # the device path has no loader: refused
    [problem] = check.refused_settings([eager])
    assert problem.startswith("train device bf16: refused: error: invalid --workers:")
