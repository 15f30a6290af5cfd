"""The CLI surface: help without torch, bad input as exit 2 with one clear line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli

COMMANDS = [["--help"], ["train", "--help"], ["checkpoint", "--help"]]


def run_importing(*args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `python -m ddpcli ARGS`; return the result and every module it imported."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ddpcli", *args],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result, [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a))
def test_help_answers_without_importing_torch(args):
    result, imported = run_importing(*args)
    assert "torch" not in imported
    assert "Usage" in result.stdout


def test_help_lists_the_four_commands():
    result = run_cli("--help", timeout=60)
    for command in ("train", "bench-barrier", "check-env", "checkpoint"):
        assert command in result.stdout


BAD_INPUT = {
    "zero batch": (["--per-gpu-batch", "0"], "--per-gpu-batch"),
    "negative epochs": (["--epochs", "-1"], "--epochs"),
    "unknown arch": (["--arch", "resnet9000"], "--arch"),
    "bad init method": (["--init-method", "udp://x:1"], "--init-method"),
    "port out of range": (["--master-port", "70000"], "--master-port"),
    "node rank not below nodes": (["--nnodes", "2", "--node-rank", "2"], "--node-rank"),
    "gpu that does not exist": (["--gpus", "0,99"], "--gpus"),
    "missing data dir": (["--dataset", "imagefolder", "--data-dir", "/no/such/dir"], "--data-dir"),
    "unknown dataset": (["--dataset", "cifar"], "--dataset"),
    "not a number": (["--epochs", "many"], "--epochs"),
    "missing recipe": (["--recipe", "/no/such.toml"], "recipe"),
    "missing interface": (["--ifname", "nosuch0"], "--ifname"),
}


@pytest.mark.parametrize("case", BAD_INPUT, ids=str)
def test_bad_input_exits_2_with_a_clear_line(case, tmp_path):
    args, names = BAD_INPUT[case]
    result = run_cli("train", *args, "--out", str(tmp_path / "out"), timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert names in result.stderr
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_unreadable_recipe_is_exit_2(tmp_path):
    recipe = tmp_path / "bad.toml"
    recipe.write_text("epochs = [unclosed\n")
    result = run_cli("train", "--recipe", str(recipe), "--dry-run", timeout=60)
    assert result.returncode == 2
    assert "not readable TOML" in result.stderr


def test_recipe_gives_defaults_and_flags_override(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[train]\nepochs = 7\nper-gpu-batch = 8\narch = "tinycnn"\n')
    result = run_cli(
        "train", "--recipe", str(recipe), "--epochs", "3", "--cpu", "--nproc", "3",
        "--accumulate", "2", "--dry-run", "--json", timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert config["epochs"] == 3  # flag beats recipe
    assert config["per_gpu_batch"] == 8  # recipe beats default
    assert config["arch"] == "tinycnn"
    assert config["world_size"] == 3
    assert config["global_batch"] == 8 * 3 * 2


def test_unknown_recipe_key_is_named(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text("epochz = 3\n")
    result = run_cli("train", "--recipe", str(recipe), "--dry-run", timeout=60)
    assert result.returncode == 2
    assert "--epochz" in result.stderr and "not a known setting" in result.stderr


def test_shipped_recipes_parse():
    for recipe in sorted((REPO / "recipes").glob("*.toml")):
        from ddpcli.config import build_train_config

        cfg = build_train_config({"data_dir": "/tmp"}, recipe)
        assert cfg.epochs >= 1


def test_python_dash_m_works_like_the_script():
    result = subprocess.run(
        [str(Path(sys.executable).parent / "ddpcli"), "train", "--dry-run", "--cpu", "--json"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    module = run_cli("train", "--dry-run", "--cpu", "--json", timeout=60)
    assert result.returncode == module.returncode == 0
    drop_out = lambda text: {k: v for k, v in json.loads(text).items() if k != "out"}  # noqa: E731
    assert drop_out(result.stdout) == drop_out(module.stdout)


def test_legacy_local_rank_argument_moves_to_the_environment():
    from ddpcli.cli import adopt_legacy_local_rank

    environ = {}
    argv = ["ddpcli", "--local_rank", "3", "train", "--epochs", "1"]
    assert adopt_legacy_local_rank(argv, environ) == ["ddpcli", "train", "--epochs", "1"]
    assert environ == {"LOCAL_RANK": "3"}
    environ = {"LOCAL_RANK": "1"}
    assert adopt_legacy_local_rank(["ddpcli", "--local-rank=1", "train"], environ) == [
        "ddpcli",
        "train",
    ]
    assert environ == {"LOCAL_RANK": "1"}


def test_launcher_checks_a_torchvision_arch_without_importing_torchvision():
    result, imported = run_importing("train", "--cpu", "--arch", "resnet18", "--dry-run")
    assert "torchvision" not in imported
    assert "arch = resnet18" in result.stdout


def test_known_arch_names_match_the_installed_torchvision_and_the_builtins():
    import torchvision

    from ddpcli import archs, models

    installed = set(torchvision.models.list_models(module=torchvision.models))
    assert not archs.KNOWN_TORCHVISION_CLASSIFIERS - installed  # no name it lacks
    assert set(archs.BUILTIN_ARCHS) == set(models.BUILTIN_MODELS)
    missing = sorted(installed - archs.KNOWN_TORCHVISION_CLASSIFIERS)
    archs.check_arch(missing[0] if missing else "resnet18")  # the fallback finds newer names
