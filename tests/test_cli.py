"""The CLI surface: help without torch, bad input as exit 2 with one clear line."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LAUNCHER_VARIABLES, REPO, run_cli

COMMANDS = [
    ["--help"],
    ["train", "--help"],
    ["bench-barrier", "--help"],
    ["check-env", "--help"],
    ["checkpoint", "--help"],
    ["checkpoint", "verify", "--help"],
    ["plot", "--help"],
]


def run_importing(*args: str, exit_code: int = 0) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `python -m ddpcli ARGS`; return the result and every module it imported."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ddpcli", *args],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == exit_code, result.stderr
    return result, [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a))
def test_help_answers_without_importing_torch(args):
    result, imported = run_importing(*args)
    assert "torch" not in imported
    assert "matplotlib" not in imported and "plotext" not in imported
    assert "Usage" in result.stdout


@pytest.mark.parametrize(
    "args,named",
    [
        (["--epochs", "0"], "invalid --epochs"),
        (["--dataset", "imagefolder", "--data-dir", "/no/such/folder"], "invalid --data-dir"),
        (["--cpu", "--ifname", "no-such-nic0"], "invalid --ifname"),
    ],
)
def test_bad_train_input_is_answered_before_torch_loads(args, named):
    """A typo costs a fraction of a second, not the seconds torch takes to load."""
    result, imported = run_importing("train", *args, exit_code=2)
    assert "torch" not in imported
    assert named in result.stderr and "Traceback" not in result.stderr


def test_help_lists_the_four_commands(in_process):
    result = in_process("--help")
    for command in ("train", "bench-barrier", "check-env", "checkpoint", "plot"):
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
def test_bad_input_exits_2_with_a_clear_line(case, tmp_path, in_process):
    args, names = BAD_INPUT[case]
    result = in_process("train", *args, "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert names in result.stderr
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


@pytest.mark.parametrize(
    "layout, dataset",
    [(("train/cat", "val/cat"), "imagefolder"), (("val/cat",), "imagefolder"),
     (("stl10_binary",), "stl10"), ((), "stl10 with --download")],
)  # fmt: skip
def test_a_data_dir_without_dataset_trains_on_what_it_holds(layout, dataset, tmp_path):
    """A --data-dir given without --dataset is never left unread for the synthetic default."""
    from ddpcli.config import build_train_config

    for folder in layout:
        (tmp_path / folder).mkdir(parents=True)
    flags = {"data_dir": str(tmp_path), "download": dataset.endswith("--download") or None}
    assert build_train_config(flags, None, environ={}).dataset == dataset.split()[0]


@pytest.mark.parametrize("exists", [True, False])
def test_a_data_dir_holding_no_data_set_is_exit_2_when_no_dataset_is_named(
    exists, tmp_path, in_process
):
    folder = tmp_path / "data"
    if exists:
        (folder / "pictures").mkdir(parents=True)
    result = in_process("train", "--data-dir", str(folder), "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    if exists:
        assert f"invalid --data-dir: {folder} holds no data set (shards' index.json, " in line
        assert "name one with --dataset, or drop --data-dir to train on the synthetic set" in line
    else:
        assert line == f"error: invalid --data-dir: {folder} does not exist or is not a folder"
    assert not (tmp_path / "out").exists()
    named = in_process("train", "--dataset", "synthetic", "--data-dir", str(folder), "--dry-run")
    assert named.returncode == 0, named.stderr  # named: the folder is not looked into


def test_unreadable_recipe_is_exit_2(tmp_path, in_process):
    recipe = tmp_path / "bad.toml"
    recipe.write_text("epochs = [unclosed\n")
    result = in_process("train", "--recipe", str(recipe), "--dry-run")
    assert result.returncode == 2
    assert "not readable TOML" in result.stderr


def test_recipe_gives_defaults_and_flags_override(tmp_path, in_process):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[train]\nepochs = 7\nper-gpu-batch = 8\narch = "tinycnn"\n')
    result = in_process(
        "train", "--recipe", str(recipe), "--epochs", "3", "--cpu", "--nproc", "3",
        "--accumulate", "2", "--dry-run", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert config["epochs"] == 3  # flag beats recipe
    assert config["per_gpu_batch"] == 8  # recipe beats default
    assert config["arch"] == "tinycnn"
    assert config["world_size"] == 3
    assert config["global_batch"] == 8 * 3 * 2


def test_unknown_recipe_key_is_named(tmp_path, in_process):
    recipe = tmp_path / "r.toml"
    recipe.write_text("epochz = 3\n")
    result = in_process("train", "--recipe", str(recipe), "--dry-run")
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

    from ddpcli.models import archs
    from ddpcli.models import build as models

    installed = set(torchvision.models.list_models(module=torchvision.models))
    assert not archs.KNOWN_TORCHVISION_CLASSIFIERS - installed  # no name it lacks
    assert set(archs.BUILTIN_ARCHS) == set(models.BUILTIN_MODELS)
    missing = sorted(installed - archs.KNOWN_TORCHVISION_CLASSIFIERS)
    archs.check_arch(missing[0] if missing else "resnet18")  # the fallback finds newer names


# --- What --help says -----------------------------------------------------------------------


def help_lines(*command: str, columns: int = 400) -> list[str]:
    """`ddpcli COMMAND --help`; by default on a terminal wide enough that no row wraps."""
    result = run_cli(*command, "--help", timeout=60, env={"COLUMNS": str(columns)})
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def option_row(lines: list[str], flag: str) -> str:
    """The help row of FLAG, without the panel's border."""
    rows = [line.strip("│ ") for line in lines if line.startswith(f"│ {flag} ")]
    assert len(rows) == 1, f"{flag} has {len(rows)} rows in help"
    return rows[0]


def test_train_help_shows_each_default_and_the_choices():
    from ddpcli.config import TrainConfig

    lines = help_lines("train")
    batch = TrainConfig.model_fields["per_gpu_batch"].default
    assert f"[default: {batch}]" in option_row(lines, "--per-gpu-batch")  # 64
    choices = "[synthetic|stl10|imagefolder|shards|pkg.module:factory]"
    assert choices in option_row(lines, "--dataset")
    assert "[default: synthetic]" in option_row(lines, "--dataset")
    assert "[ddp|dp|balanced-dp]" in option_row(lines, "--strategy")
    assert "[linear|sqrt|none]" in option_row(lines, "--lr-scaling")
    assert "[default: all GPUs, else 2 CPU processes]" in option_row(lines, "--gpus")
    assert "[default: no-cpu]" in option_row(lines, "--cpu")
    from ddpcli.launcher import resolve  # the words for values the machine decides, kept in step

    sizes = resolve.NATIVE_IMAGE_SIZE
    folder = resolve.IMAGEFOLDER_SIZE
    assert (
        f"[default: {sizes['synthetic']} synthetic, {sizes['stl10']} stl10, "
        f"{folder['gpu']} imagefolder ({folder['cpu']} on the CPU)]"
    ) in option_row(lines, "--image-size")
    assert f"{resolve.DEFAULT_MASTER_PORT} on several nodes]" in option_row(lines, "--master-port")
    flags_without_value = {"--dry-run", "--json", "--help"}
    from ddpcli.config.common import FLAG_SPELLINGS, flag_settings

    # The config says which settings are flags: not the resolved ones, not those ddpcli's
    # environment variables give, not --nnodes MIN:MAX's MIN.
    for name in flag_settings(TrainConfig):
        flag = FLAG_SPELLINGS.get(name, f"--{name.replace('_', '-')}")
        if flag not in flags_without_value:
            assert "[default: " in option_row(lines, flag), flag


@pytest.mark.parametrize(
    "command", [["train"], ["bench-barrier"], ["check-env"], ["checkpoint", "convert"], []],
    ids=lambda c: " ".join(c) or "root",
)  # fmt: skip
def test_flags_that_take_no_value_show_no_type(command):
    lines = help_lines(*command)
    assert not [line for line in lines if "<bool>" in line]
    flags = {
        "train": ["--cpu", "--compile", "--download", "--dry-run", "--json", "--help"],
        "checkpoint": ["--strip-ddp-prefix", "--weights-only", "--json"],
    }.get(command[0] if command else "", ["--help"])
    for flag in flags:
        assert "<" not in option_row(lines, flag), flag  # no <bool>, <int>: their help has no <


def test_every_boolean_setting_of_train_has_its_no_form():
    from ddpcli.config import TrainConfig

    lines = help_lines("train")
    for name, field in TrainConfig.model_fields.items():
        if field.annotation is bool and name != "wandb_offline":  # resolved, never given
            flag = name.replace("_", "-")
            assert f"--no-{flag}" in option_row(lines, f"--{flag}")


@pytest.mark.parametrize("group", [[], ["checkpoint"]], ids=lambda g: " ".join(g) or "root")
def test_command_summaries_are_whole_sentences(group):
    """One row per command on an 80-column terminal, its summary a sentence with its full
    stop: Typer shows the first paragraph of each docstring."""
    lines = help_lines(*group, columns=80)
    start = next(index for index, line in enumerate(lines) if "Commands" in line)
    rows = [line.strip("│ ") for line in lines[start + 1 :] if line.startswith("│")]
    from typer.main import get_command

    from ddpcli.cli import app

    commands = get_command(app)
    for part in group:
        commands = commands.commands[part]
    assert len(rows) == len(commands.commands)  # a wrapped summary adds a row
    for row in rows:
        name, _, summary = row.partition("  ")
        assert name in commands.commands, row
        assert summary.strip().endswith("."), row


def test_a_no_flag_overrides_a_recipe_true(tmp_path, monkeypatch):
    """`--no-cpu` and `--no-compile` beat a recipe's `true`; left out, the recipe stands."""
    from typer.testing import CliRunner

    from ddpcli.cli import app

    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("ddpcli.launcher.resolve.physical_gpu_count", lambda: 2)  # a GPU machine
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # whose GPUs torch can use
    recipe = tmp_path / "r.toml"
    recipe.write_text("[train]\ncpu = true\ncompile = true\n")

    def dry_run(*flags: str) -> dict:
        result = CliRunner().invoke(
            app, ["train", "--recipe", str(recipe), *flags, "--dry-run", "--json"]
        )
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    from_recipe = dry_run()
    assert from_recipe["cpu"] is True and from_recipe["compile"] is True
    overridden = dry_run("--no-cpu", "--no-compile")
    assert overridden["cpu"] is False and overridden["compile"] is False
    assert overridden["gpus"] == [0, 1]


def test_progress_says_no_rate_before_the_timed_window_opens(capsys, monkeypatch):
    import io

    from rich.console import Console

    from ddpcli import ui

    progress = ui.TrainProgress(enabled=True, epochs=2, steps_per_epoch=10)
    progress.start_epoch(0, 0)
    progress.update(1, 2.3, 0.1, None)
    progress.update(5, 2.1, 0.2, 1234.4)
    first, later = capsys.readouterr().err.splitlines()
    assert "0 img/s" not in first and "· -- img/s" in first
    assert "1234 img/s" in later

    terminal = io.StringIO()  # the live bar, as on a terminal
    monkeypatch.setattr(ui, "console", Console(file=terminal, force_terminal=True, width=120))
    with ui.TrainProgress(enabled=True, epochs=2, steps_per_epoch=10) as bar:
        bar.start_epoch(0, 0)
        bar.update(1, 2.3, 0.1, None)
        bar.bar.refresh()
    assert "-- img/s" in terminal.getvalue() and "0 img/s" not in terminal.getvalue()


# --- Recipes: nothing ignored, nothing ambiguous, flags always win --------------------------


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("epochs = 7\n[train]\nper_gpu_batch = 8\n", "sets epochs outside its [train] table"),
        ("[train]\nper-gpu-batch = 8\nper_gpu_batch = 16\n", "sets per_gpu_batch twice"),
        ("[train]\nepochs = 2\n[data]\nworkers = 2\n", "sets data outside its [train] table"),
    ],
    ids=["key beside the table", "two spellings", "another table"],
)
def test_a_recipe_setting_that_would_be_ignored_or_ambiguous_is_exit_2(tmp_path, text, words):
    from ddpcli.config import build_train_config
    from ddpcli.errors import DdpcliError

    recipe = tmp_path / "r.toml"
    recipe.write_text(text)
    with pytest.raises(DdpcliError) as refused:
        build_train_config({}, recipe)
    assert refused.value.exit_code == 2
    assert refused.value.message.startswith("invalid --recipe:") and words in refused.value.message


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--download"], "invalid --download: it fetches STL-10, and --dataset synthetic is "
                         "read as it is; drop --download"),
        (["--skip-bad-images"], "invalid --skip-bad-images: it leaves out image files that "
                                "cannot be decoded, and --dataset synthetic has none"),
        (["--ema-decay", "0.9"], "invalid --ema-decay: it tunes --ema's average of the "
                                 "weights, which is off; add --ema, or drop --ema-decay"),
        (["--ema-steps", "4"], "invalid --ema-steps: it tunes --ema's average"),
        (["--dataset", "stl10", "--data-dir", "DIR", "--synthetic-size", "64"],
         "invalid --synthetic-size: it sizes the synthetic set, and --dataset stl10 is read "
         "from --data-dir; drop --synthetic-size"),
        (["--data-path", "device", "--workers", "4"],
         "invalid --workers: --data-path device holds the set in device memory and augments "
         "it there, with no loader; drop --workers, or use --data-path loader"),
    ],
    ids=["download", "skip-bad-images", "ema-decay", "ema-steps", "synthetic-size", "workers"],
)  # fmt: skip
def test_a_setting_that_would_do_nothing_for_the_run_is_exit_2(flags, words, tmp_path, in_process):
    flags = [str(tmp_path) if flag == "DIR" else flag for flag in flags]
    result = in_process("train", "--cpu", *flags, "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert words in line
    assert not (tmp_path / "out").exists()


def test_a_flag_that_switches_a_recipe_setting_off_drops_what_only_tuned_it(tmp_path):
    """The recipe's EMA and STL-10 settings, and flags that turn them off: the flags win,
    and the settings that only served them go with them rather than being refused."""
    from ddpcli.config import build_train_config

    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[train]\ndataset = "stl10"\ndownload = true\nema = true\nema_decay = 0.999\n'
        "ema_steps = 4\n"
    )
    (tmp_path / "pictures" / "train" / "cat").mkdir(parents=True)
    flags = {"ema": False, "dataset": "imagefolder",
             "data_dir": str(tmp_path / "pictures")}  # fmt: skip
    cfg = build_train_config(flags, recipe, environ={})
    assert (cfg.dataset, cfg.download, cfg.ema) == ("imagefolder", False, False)
    assert (cfg.ema_decay, cfg.ema_steps) == (0.99998, 32)  # the defaults, not the recipe's


def test_a_binary_recipe_is_exit_2_naming_the_flag(tmp_path, in_process):
    recipe = tmp_path / "model.pt"
    recipe.write_bytes(b"PK\x03\x04\x14\x00\x00\x00\x08\x00\xff\xfe\x80\x81" * 16)
    result = in_process("train", "--recipe", str(recipe), "--dry-run")
    assert result.returncode == 2, result.stderr
    assert "invalid --recipe:" in result.stderr and "not a text file" in result.stderr
    assert "UnicodeDecodeError" not in result.stderr


def test_a_flag_overrides_the_recipe_side_of_an_exclusion(tmp_path, monkeypatch):
    """A recipe's `cpu = true` and `--gpus 0`: the flag wins; both in one place is an error
    that says where each side came from."""
    from typer.testing import CliRunner

    from ddpcli.cli import app

    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("ddpcli.launcher.resolve.physical_gpu_count", lambda: 2)  # a GPU machine
    monkeypatch.setattr("ddpcli.machine.physical_gpu_count", lambda: 2)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # whose GPUs torch can use
    recipe = tmp_path / "r.toml"
    recipe.write_text("[train]\ncpu = true\n")

    def train(*flags: str):
        return CliRunner().invoke(
            app, ["train", "--recipe", str(recipe), *flags, "--dry-run", "--json"]
        )

    overridden = train("--gpus", "0")
    assert overridden.exit_code == 0, overridden.stderr
    assert json.loads(overridden.stdout)["gpus"] == [0] and not json.loads(overridden.stdout)["cpu"]
    both_flags = train("--gpus", "0", "--cpu")
    assert both_flags.exit_code == 2
    assert "--cpu from the command line; --gpus from the command line" in both_flags.stderr
    recipe.write_text('[train]\ncpu = true\ngpus = "0"\n')
    both_in_recipe = train()
    assert both_in_recipe.exit_code == 2
    assert f"--cpu from recipe {recipe}; --gpus from recipe {recipe}" in both_in_recipe.stderr


# Settings that exclude each other: the flags of one side, the recipe's line of the other.
FLAG_BEATS_RECIPE = [
    ({"optimizer": "adamw"}, "momentum = 0.8"),
    ({"momentum": 0.8}, 'optimizer = "adamw"'),  # either side may be the flag
    ({"optimizer": "sgd"}, "betas = [0.9, 0.99]"),
    ({"tracker": "csv"}, 'tracking_uri = "file:///tmp/mlruns"'),
    ({"accumulate": 2}, "static_graph = true"),
    ({"overwrite": True}, 'resume = "auto"'),
    ({"max_steps": 5}, 'profile_steps = "10:15"'),
    ({"compile": True}, 'strategy = "dp"'),
    ({"strategy": "ddp"}, "gpu0_batch = 8"),
    ({"precision": "fp16"}, 'grad_compression = "powersgd:2"'),
    ({"per_gpu_batch": "auto"}, "sync_bn = true"),
    ({"compile": True, "compile_mode": "reduce-overhead"}, 'per_gpu_batch = "auto"'),
    ({"dataset": "synthetic"}, "skip_bad_images = true"),
    ({"data_path": "device"}, "workers = 4"),
    ({"dataset": "imagefolder", "data_dir": "/tmp"}, "shuffle_buffer = 100"),
    ({"dataset": "imagefolder", "data_dir": "/tmp", "decode": "gpu"}, 'data_path = "device"'),
]


@pytest.mark.parametrize(("flags", "line"), FLAG_BEATS_RECIPE, ids=lambda x: str(x))
def test_a_flag_beats_the_recipes_side_of_every_exclusion(tmp_path, flags, line):
    """Each refusal of two settings is the one statement of its rule: with both sides in the
    recipe (or both flags) it stands, naming where each came from; with a flag on one side,
    the recipe's other side is left out and its default applies, as docs/train.md says."""
    from ddpcli.config import build_train_config
    from ddpcli.errors import DdpcliError

    recipe = tmp_path / "r.toml"
    field = line.split(" = ")[0]
    recipe.write_text(f"[train]\n{line}\n")
    cfg = build_train_config(flags, recipe, environ={})
    assert getattr(cfg, field) == getattr(build_train_config(flags, None, environ={}), field)
    both = [f"{name} = {json.dumps(value)}" for name, value in flags.items()]
    recipe.write_text("\n".join(["[train]", line, *both]) + "\n")
    with pytest.raises(DdpcliError) as refused:
        build_train_config({}, recipe, environ={})
    assert refused.value.exit_code == 2 and f"from recipe {recipe}" in refused.value.message


def test_what_a_flag_leaves_out_of_the_recipe_is_said_before_the_run(tmp_path, in_process):
    recipe = tmp_path / "r.toml"
    recipe.write_text("[train]\nmomentum = 0.8\nema = true\nema_decay = 0.999\nepochs = 2\n")
    result = in_process(
        "train", "--recipe", str(recipe), "--optimizer", "adamw", "--no-ema", "--cpu",
        "--dry-run", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[:2] == [
        f"recipe {recipe}: --momentum 0.8 left out, as --optimizer adamw on the command line "
        "excludes it",
        f"recipe {recipe}: --ema-decay 0.999 left out, as --no-ema on the command line excludes it",
    ]
    settings = json.loads(result.stdout)
    assert (settings["momentum"], settings["ema_decay"], settings["epochs"]) == (None, 0.99998, 2)


@pytest.mark.parametrize("timeout", ["0.001", "0", "-3"])
def test_a_timeout_below_a_second_is_exit_2(timeout):
    from ddpcli.config import build_train_config
    from ddpcli.errors import DdpcliError

    with pytest.raises(DdpcliError) as refused:
        build_train_config({"timeout": float(timeout)}, None)
    assert refused.value.exit_code == 2
    assert refused.value.message.startswith("invalid --timeout: at least 1 s")


def test_overwrite_is_a_setting_with_its_no_form(tmp_path, in_process):
    result = in_process(
        "train", "--cpu", "--overwrite", "--out", str(tmp_path), "--dry-run", "--json"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["overwrite"] is True


# --- Numbers are finite, types are the flags', each setting belongs to its optimizer --------


def build(command: str, flags: dict):
    """COMMAND's config from FLAGS, as its CLI builds it."""
    from ddpcli import config

    builders = {
        "train": lambda: config.build_train_config(flags, None, environ={}),
        "launch": lambda: config.build_launch_config({"target": "x.py", **flags}, environ={}),
        "bench-barrier": lambda: config.build_barrier_config(flags),
        "check-env": lambda: config.build_check_options(flags, environ={}),
    }
    return builders[command]()


NON_FINITE = [
    ("train", "lr"), ("train", "weight_decay"), ("train", "warmup_epochs"), ("train", "timeout"),
    ("train", "mixup_alpha"), ("train", "cutmix_alpha"), ("train", "bucket_cap_mb"),
    ("train", "norm_weight_decay"), ("train", "ema_decay"), ("launch", "timeout"),
    ("bench-barrier", "timeout"), ("bench-barrier", "stagger"), ("check-env", "timeout"),
    ("check-env", "stage_timeout"),
]  # fmt: skip


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize(("command", "field"), NON_FINITE, ids=lambda x: str(x))
def test_a_non_finite_number_is_refused_by_every_command(command, field, value):
    from ddpcli.errors import DdpcliError

    with pytest.raises(DdpcliError) as refused:
        build(command, {field: value})
    flag = f"--{field.replace('_', '-')}"
    assert refused.value.exit_code == 2
    assert refused.value.message == f"invalid {flag}: must be a finite number (got {value!r})"


def test_lr_inf_on_the_command_line_is_exit_2_in_one_line(in_process):
    result = in_process("train", "--cpu", "--lr", "inf", "--dry-run")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == "error: invalid --lr: must be a finite number (got inf)"


def test_a_non_finite_number_in_a_list_or_a_recipe_is_refused(tmp_path):
    from ddpcli.config import build_train_config
    from ddpcli.errors import DdpcliError

    recipe = tmp_path / "r.toml"
    recipe.write_text("[train]\nlr = inf\n")
    with pytest.raises(DdpcliError, match=r"invalid --lr: must be a finite number \(got inf\)"):
        build_train_config({}, recipe, environ={})
    with pytest.raises(DdpcliError, match="invalid --sleeps: must be a finite number"):
        build("bench-barrier", {"sleeps": "0,nan", "nproc": 2})


def test_momentum_with_adamw_is_refused_as_betas_with_sgd_are(tmp_path):
    from ddpcli.config import build_train_config
    from ddpcli.errors import DdpcliError

    with pytest.raises(DdpcliError, match="invalid --momentum: it is SGD's") as refused:
        build("train", {"optimizer": "adamw", "momentum": 0.5})
    assert refused.value.exit_code == 2
    recipe = tmp_path / "r.toml"
    recipe.write_text("[train]\nmomentum = 0.8\n")  # SGD's, and --optimizer adamw wins
    assert build_train_config({"optimizer": "adamw"}, recipe, environ={}).momentum is None
    recipe.write_text("[train]\nmomentum = 0.8\noptimizer = 'adamw'\n")  # wrong in itself
    with pytest.raises(DdpcliError, match=f"--momentum from recipe {recipe}"):
        build_train_config({}, recipe, environ={})
    assert build("train", {"momentum": 0.5}).momentum == 0.5
    assert build("train", {}).momentum == 0.9  # SGD's default
    assert build("train", {"optimizer": "adamw"}).momentum is None  # not AdamW's setting


def test_powersgd_start_step_without_powersgd_is_refused_as_momentum_with_adamw_is(tmp_path):
    """It delays PowerSGD; with --grad-compression none, fp16 or bf16 it would do nothing."""
    from ddpcli.config import build_train_config
    from ddpcli.errors import DdpcliError

    for compression in ({}, {"grad_compression": "bf16"}):
        with pytest.raises(DdpcliError, match="invalid --powersgd-start-step: ") as refused:
            build("train", {"powersgd_start_step": 200, **compression})
        assert refused.value.exit_code == 2 and "--grad-compression powersgd" in str(refused.value)
    recipe = tmp_path / "r.toml"
    recipe.write_text("[train]\npowersgd_start_step = 200\n")
    with pytest.raises(DdpcliError, match=f"--powersgd-start-step from recipe {recipe}"):
        build_train_config({}, recipe, environ={})
    recipe.write_text("[train]\npowersgd_start_step = 200\ngrad_compression = 'powersgd'\n")
    overruled = build_train_config({"grad_compression": "fp16"}, recipe, environ={})
    assert (overruled.grad_compression, overruled.powersgd_start_step) == ("fp16", 1000)
    given = build("train", {"powersgd_start_step": 200, "grad_compression": "powersgd:2"})
    assert given.powersgd_start_step == 200
    assert build("train", {}).powersgd_start_step == 1000  # the default is no one's word


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("epochs = true", "invalid --epochs: must be a valid integer (got True)"),
        ("epochs = 2.0", "invalid --epochs: must be a valid integer (got 2.0)"),
        ('cpu = "yes"', "invalid --cpu: must be a valid boolean (got 'yes')"),
        ("cpu = 1", "invalid --cpu: must be a valid boolean (got 1)"),
        ('lr = "0.1"', "invalid --lr: must be a valid number (got '0.1')"),
        ("lr = false", "invalid --lr: must be a valid number (got False)"),
        ('betas = ["0.9", 0.99]', "invalid --betas: must be a valid number (got '0.9')"),
        (
            'per_gpu_batch = "32"',
            "invalid --per-gpu-batch: must be a valid integer, or \"auto\" (got '32')",
        ),
    ],
)
def test_a_recipe_value_of_the_wrong_type_is_refused_not_converted(tmp_path, line, said):
    from ddpcli.config import build_train_config
    from ddpcli.errors import DdpcliError

    recipe = tmp_path / "r.toml"
    recipe.write_text(f"[train]\noptimizer = 'adamw'\n{line}\n")
    with pytest.raises(DdpcliError) as refused:
        build_train_config({}, recipe, environ={})
    assert refused.value.exit_code == 2
    flag = said.split(":")[0].removeprefix("invalid ")
    assert refused.value.message == f"{said} ({flag} from recipe {recipe})"


def test_a_recipe_keeps_the_forms_toml_users_write(tmp_path):
    """A whole number for a float, a path as a string, --gpus and --nnodes in their text forms."""
    from ddpcli.config import build_train_config

    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[train]\nlr = 1\nwarmup_epochs = 0\nout = "runs/x"\ngpus = "0,3"\nnnodes = "1:2"\n'
        'betas = [0, 0.5]\noptimizer = "adamw"\nmodel_args = {depth = 4}\n'
    )
    cfg = build_train_config({}, recipe, environ={})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.warmup_epochs == 0.0
    assert str(cfg.out) == "runs/x" and cfg.gpus == [0, 3]
    assert (cfg.min_nnodes, cfg.nnodes) == (1, 2) and cfg.betas == [0.0, 0.5]
    assert cfg.model_args == {"depth": 4}


def test_a_recipes_wrong_value_is_refused_even_where_a_flag_overrides_it(tmp_path):
    """The recipe is checked whole: the same file must not be right or wrong by the flags
    given beside it (the next run without --epochs would meet `epochs = true`)."""
    from ddpcli.config import build_train_config
    from ddpcli.errors import DdpcliError

    recipe = tmp_path / "r.toml"
    for line, flags, said in (
        ("epochs = true", {"epochs": 3}, "invalid --epochs: must be a valid integer (got True)"),
        ('cpu = "yes"', {"gpus": "0"}, "invalid --cpu: must be a valid boolean (got 'yes')"),
    ):
        recipe.write_text(f"[train]\n{line}\n")
        with pytest.raises(DdpcliError) as refused:
            build_train_config(flags, recipe, environ={})
        assert refused.value.exit_code == 2
        flag = said.split(":")[0].removeprefix("invalid ")
        assert refused.value.message.startswith(f"{said} ({flag} from recipe {recipe}")
    recipe.write_text("[train]\nepochs = 2\n")
    assert build_train_config({"epochs": 3}, recipe, environ={}).epochs == 3
