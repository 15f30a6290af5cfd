"""Your own model and data: `--arch pkg.module:factory`, `--model-arg`, `--dataset
pkg.module:factory`, `--init-from`, `--optimizer adamw`, timm. The user's code is a module
each test writes into its temporary folder, and the command runs from there, as a user
runs it from their project."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, read_metrics, run_cli, traced_records

MODEL_FILE = """
import torch
from torch import nn


class PatchNet(nn.Module):
    def __init__(self, num_classes, width=8):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, images):
        return self.head(self.body(images))


def patchnet(num_classes, width=8):
    return PatchNet(num_classes, width)


def not_a_module(num_classes):
    return "a string"


def wrong_width(num_classes):
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, num_classes + 1))


def raises(num_classes):
    raise RuntimeError("the factory broke")


NOT_CALLABLE = 3
"""

TINY = ["--cpu", "--nproc", "2", "--image-size", "16", "--per-gpu-batch", "8"]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project folder holding their model module."""
    (tmp_path / "mymodels.py").write_text(textwrap.dedent(MODEL_FILE))
    (tmp_path / "broken.py").write_text("import a_package_that_is_not_there\n")
    return tmp_path


def run_in(project: Path, *args: str, timeout: float = 60):
    """`python -m ddpcli ARGS` from the user's project folder (this checkout's ddpcli)."""
    return run_cli(*args, timeout=timeout, cwd=project, env={"PYTHONPATH": str(REPO)})


@pytest.fixture
def refused_in(monkeypatch):
    """`ddpcli ARGS` in this process, from the user's project folder, for a command that ends
    before any worker starts: an exit 2, a --dry-run, a checkpoint convert (no interpreter and
    torch import per call). The user's modules, and the folder the import adds to sys.path,
    are gone afterwards."""
    from typer.testing import CliRunner

    from ddpcli.cli import app

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("COLUMNS", "200")  # one line, as run_cli's environment has it
    before = set(sys.modules)

    def invoke(project: Path, *args: str):
        monkeypatch.chdir(project)
        return CliRunner().invoke(app, list(args))

    yield invoke
    for name in set(sys.modules) - before:
        if name.startswith(USER_MODULES):
            del sys.modules[name]


USER_MODULES = ("mymodels", "mydata", "broken", "nowhere", "nothere", "ddpcli_user_", "timm")


def import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def patchnet_run(tmp_path_factory) -> tuple[Path, Path, str]:
    """One run of the user's model trained by AdamW (its project, --out, stderr), checked by
    the custom-model test and the AdamW test alike."""
    project = tmp_path_factory.mktemp("patchnet")
    (project / "mymodels.py").write_text(textwrap.dedent(MODEL_FILE))
    out = project / "run"
    result = run_in(
        project, "train", *TINY, "--arch", "mymodels:patchnet", "--model-arg", "width=6",
        "--synthetic-size", "64", "--epochs", "1", "--optimizer", "adamw", "--betas", "0.9,0.95",
        "--out", str(out), "--json", timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return project, out, result.stderr


def test_a_custom_model_trains_and_its_checkpoint_loads_back_into_the_users_class(
    patchnet_run, refused_in, tmp_path
):
    project, out, stderr = patchnet_run
    assert "mymodels:patchnet on synthetic" in stderr
    config = json.loads((out / "config.json").read_text())
    assert config["arch"] == "mymodels:patchnet" and config["model_args"] == {"width": 6}
    assert read_metrics(out)[0]["world_size"] == 2

    converted = tmp_path / "weights.pt"
    convert = refused_in(
        project, "checkpoint", "convert", str(out / "checkpoints" / "last.pt"), str(converted)
    )
    assert convert.exit_code == 0, convert.output
    hint = "from mymodels import patchnet; patchnet(num_classes=10, width=6).load_state_dict("
    assert hint in convert.stdout + convert.stderr
    import torch

    user_module = import_file(project / "mymodels.py", "mymodels_loaded_back")
    model = user_module.PatchNet(num_classes=10, width=6)
    model.load_state_dict(torch.load(converted, weights_only=True))  # strict: every key fits


def test_dry_run_builds_the_model_and_names_its_class_and_size(project, refused_in):
    result = refused_in(
        project, "train", "--cpu", "--arch", "mymodels.py:patchnet", "--model-arg", "width=4",
        "--dry-run", "--json", "--out", str(project / "run"),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["model_class"].endswith("PatchNet")
    # conv 3*4*9 + 4, BN 2*4, linear 4*10 + 10
    assert shown["parameters"] == 108 + 4 + 8 + 50
    assert shown["model_args"] == {"width": 4}


@pytest.mark.parametrize(
    ("arch", "words"),
    [
        ("broken:make", "no module 'a_package_that_is_not_there' (importing broken)"),
        ("nowhere.models:make", "invalid --arch: no module 'nowhere'"),
        ("mymodels:missing", "invalid --arch: mymodels has no attribute 'missing'"),
        ("mymodels:NOT_CALLABLE", "is of type int, not a callable"),
        ("mymodels:not_a_module", "returned a value of type str, not a torch.nn.Module"),
        ("mymodels:wrong_width", "(batch, num_classes) = (2, 10) for 2 images; it returned (2, 11"),
        ("mymodels:raises", "raises(num_classes=10) raised RuntimeError: the factory broke"),
        ("nothere.py:make", "invalid --arch: nothere.py does not exist"),
        ("timm:resnet18", "timm models need timm, which is not installed; pip install"),
    ],
)  # fmt: skip
def test_each_bad_model_factory_exits_2_before_any_worker_starts(project, refused_in, arch, words):
    out = project / "run"
    result = refused_in(project, "train", *TINY, "--arch", arch, "--out", str(out))
    assert result.exit_code == 2, result.output
    assert words in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (out / "config.json").exists()  # no worker ever ran


def test_model_args_are_toml_values_and_refused_when_malformed(project, refused_in):
    from ddpcli.config import build_train_config

    cfg = build_train_config(
        {"model_args": ["depth=4", "rate=0.5", "act=relu", "sizes=[1, 2]", "bias=false"]}, None
    )
    assert cfg.model_args == {
        "depth": 4,
        "rate": 0.5,
        "act": "relu",
        "sizes": [1, 2],
        "bias": False,
    }
    bad = refused_in(
        project, "train", "--cpu", "--arch", "mymodels:patchnet", "--model-arg", "width",
        "--dry-run",
    )  # fmt: skip
    assert bad.exit_code == 2, bad.output
    assert "invalid --model-arg: give KEY=VALUE" in bad.stderr
    unknown = refused_in(
        project, "train", "--cpu", "--arch", "tinycnn", "--model-arg", "depth=3", "--dry-run"
    )
    assert unknown.exit_code == 2, unknown.output
    assert "invalid --model-arg for --arch tinycnn" in unknown.stderr and "depth" in unknown.stderr


# --- Your own data set -----------------------------------------------------------------------

DATA_FILE = """
import torch
from PIL import Image


class Stripes(torch.utils.data.Dataset):
    # Class c brightens channel c; float CHW tensors, or PIL images with pil=True.
    def __init__(self, count, size, seed, pil=False):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(3, (count,), generator=generator)
        self.size, self.pil = size, pil

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        label = int(self.labels[index])
        image = torch.full((3, self.size + 4, self.size), 0.2)
        image[label] = 0.9
        if self.pil:
            return Image.fromarray((image * 255).byte().permute(1, 2, 0).numpy()), label
        return image, label


def stripes(data_dir, image_size):
    # 21 validation images: odd, so a padded sampler would count one twice on 2 ranks.
    return Stripes(64, image_size, 0), Stripes(21, image_size, 1, pil=True), ["r", "g", "b"]


def two_things(data_dir, image_size):
    return Stripes(64, image_size, 0), Stripes(21, image_size, 1)


def label_out_of_range(data_dir, image_size):
    return Stripes(64, image_size, 0), [(torch.zeros(3, 8, 8), 7)], ["r", "g", "b"]


def names_as_text(data_dir, image_size):
    return Stripes(64, image_size, 0), Stripes(21, image_size, 1), "rgb"


def bad_image(data_dir, image_size):
    return Stripes(64, image_size, 0), [(torch.zeros(8, 8), 0)], ["r", "g", "b"]


def floats_to_255(data_dir, image_size):
    return [(torch.full((3, 8, 8), 200.0), 0)], Stripes(21, image_size, 1), ["r", "g", "b"]


def normalised(data_dir, image_size):
    image = (torch.rand(3, 8, 8) - 0.45) / 0.226  # as Normalize(ImageNet's mean, std) leaves it
    return Stripes(64, image_size, 0), [(image, 1)], ["r", "g", "b"]
"""


@pytest.fixture
def data_project(project: Path) -> Path:
    (project / "mydata.py").write_text(textwrap.dedent(DATA_FILE))
    return project


def traced(trace: Path, world_size: int) -> dict[int, list[int]]:
    """Epoch -> every training index any rank was handed, in the trace files."""
    seen: dict[int, list[int]] = {}
    for rank in range(world_size):
        for batch in traced_records(trace, rank):
            seen.setdefault(batch["epoch"], []).extend(batch["indices"])
    return seen


def test_a_custom_dataset_trains_with_exact_validation_and_an_exact_resume(data_project):
    out, trace = data_project / "run", data_project / "trace"
    common = [
        "train", *TINY, "--arch", "mymodels:patchnet", "--dataset", "mydata:stripes",
        "--epochs", "2", "--out", str(out),
    ]  # fmt: skip
    env = {"PYTHONPATH": str(REPO), "DDPCLI_TRACE_SAMPLES": str(trace)}
    stopped = run_cli(*common, "--max-steps", "3", timeout=180, cwd=data_project, env=env)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resumed = run_cli(*common, "--resume", "auto", timeout=180, cwd=data_project, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    metrics = read_metrics(out)
    assert [m["epoch"] for m in metrics if not m.get("partial")] == [1, 2]
    assert all(m["val_samples"] == 21 for m in metrics)  # each image once, on one rank
    # 64 images, 2 ranks, batch 8: every image trained exactly once per epoch, the
    # interruption after step 3 included.
    seen = traced(trace, 2)
    assert sorted(seen[0]) == sorted(seen[1]) == list(range(64))
    assert json.loads((out / "config.json").read_text())["dataset"] == "mydata:stripes"


@pytest.mark.parametrize(
    ("dataset", "words"),
    [
        ("mydata:two_things", "must return (train, val, class_names); it returned a tuple of 2"),
        ("mydata:label_out_of_range", "val item 0's label must be a class index 0..2"),
        ("mydata:names_as_text", "class_names (the third of (train, val, class_names)) must be"),
        ("mydata:bad_image", "must be a PIL image or a (3, H, W) tensor"),
        ("mydata:floats_to_255", "train item 0's image holds floats from 200 to 200, not in"),
        ("mydata:normalised", "val item 0's image holds floats from -"),
        ("mydata:nowhere", "invalid --dataset: mydata has no attribute 'nowhere'"),
    ],
)  # fmt: skip
def test_each_bad_dataset_factory_exits_2_before_any_worker_starts(
    data_project, refused_in, dataset, words
):
    out = data_project / "run"
    result = refused_in(data_project, "train", *TINY, "--dataset", dataset, "--out", str(out))
    assert result.exit_code == 2, result.output
    assert words in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (out / "config.json").exists()


@pytest.mark.parametrize(
    ("low", "high", "seen"),
    [(0.0, 255.0, "from 0 to 255"), (-2.1, 2.6, "from -2.1 to 2.6"), (0.0, 1.5, "from 0 to 1.5")],
)
def test_float_images_outside_0_1_are_refused_naming_the_range_never_clamped(low, high, seen):
    import torch

    from ddpcli.data.custom import BadItem, as_uint8_image
    from ddpcli.errors import USAGE

    image = torch.linspace(low, high, 3 * 4 * 4).view(3, 4, 4)
    with pytest.raises(BadItem) as caught:
        as_uint8_image(image, "mydata:x train item 5")
    assert caught.value.exit_code == USAGE
    assert f"train item 5's image holds floats {seen}, not in [0, 1]" in caught.value.message


def test_float_images_in_0_1_are_taken_and_resampling_overshoot_is_rounded_off():
    import torch

    from ddpcli.data.custom import as_uint8_image

    image = torch.tensor([0.0, 0.5, 1.0, -0.004, 1.003, 0.2]).view(3, 2, 1)  # bicubic's overshoot
    assert as_uint8_image(image, "x").flatten().tolist() == [0, 128, 255, 0, 255, 51]


def test_a_factory_s_16_bit_pil_image_keeps_its_range():
    import numpy as np
    from PIL import Image

    from ddpcli.data.custom import as_uint8_image

    values = np.array([[0, 257 * 100, 65535]], dtype=np.uint16)  # 8-bit 0, 100, 255
    image = as_uint8_image(Image.fromarray(values), "x")  # mode I;16
    assert image.shape == (3, 1, 3) and image[0, 0].tolist() == [0, 100, 255]


# --- Fine-tuning from someone's weights ------------------------------------------------------


def test_init_from_then_reset_head_fine_tunes_to_another_class_count(data_project, refused_in):
    import torch

    user_module = import_file(data_project / "mymodels.py", "mymodels_for_init")
    source = user_module.PatchNet(num_classes=10, width=6).state_dict()
    weights = data_project / "ten-classes.pt"  # a plain state dict, saved by a DDP run
    torch.save({f"module.{key}": tensor for key, tensor in source.items()}, weights)
    common = [
        "train", *TINY, "--arch", "mymodels:patchnet", "--dataset", "mydata:stripes",
        "--epochs", "1", "--init-from", str(weights), "--out", str(data_project / "run"),
    ]  # fmt: skip

    other_classes = refused_in(data_project, *common, "--model-arg", "width=6")
    assert other_classes.exit_code == 2, other_classes.output
    assert "head.weight is [10, 6] in the file, [3, 6] here" in other_classes.stderr
    assert "add --reset-head" in other_classes.stderr

    other_body = refused_in(data_project, *common, "--model-arg", "width=5", "--reset-head")
    assert other_body.exit_code == 2, other_body.output
    assert "does not fit this model (body.0.weight is [6, 3, 3, 3] in the file" in other_body.stderr

    tuned = run_in(data_project, *common, "--model-arg", "width=6", "--reset-head", timeout=180)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    # conv 2 + BatchNorm 5 (weight, bias, running mean and var, batches tracked)
    assert "loaded 7 tensors · reset (--reset-head) 2: head.weight, head.bias" in tuned.stderr
    assert "missing, left as built 0 · unexpected, ignored 0" in tuned.stderr
    run = data_project / "run"
    assert read_metrics(run)[0]["step"] == 4  # a fresh start: 64 images / (2 x 8) per step
    tuned_head = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert tuned_head["head.weight"].shape == (3, 6)
    config = json.loads((run / "config.json").read_text())
    assert config["init_from"] == str(weights) and config["reset_head"] is True


# --- AdamW and timm --------------------------------------------------------------------------


def test_adamw_trains_and_the_header_says_its_lr_scaling(patchnet_run):
    _, out, stderr = patchnet_run
    # 0.001 per 256 images at a global batch of 16: x sqrt(16/256) = 0.00025
    assert "adamw (betas 0.9, 0.95, weight decay 0.05; --lr-scaling sqrt, adamw's default)" in (
        stderr
    )
    assert "lr 0.001 per 256 images -> 0.00025 at global batch 16 (sqrt)" in stderr
    config = json.loads((out / "config.json").read_text())
    assert config["optimizer"] == "adamw" and config["betas"] == [0.9, 0.95]
    assert config["lr_scaling"] == "sqrt" and config["peak_lr"] == 0.00025
    import torch

    saved = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert tuple(saved["optimizer"]["param_groups"][0]["betas"]) == (0.9, 0.95)
    assert "exp_avg_sq" in next(iter(saved["optimizer"]["state"].values()))  # AdamW's state


def test_sgd_keeps_its_defaults_and_betas_need_adamw():
    from ddpcli.config import build_train_config

    sgd = build_train_config({"arch": "resnet18"}, None)
    assert (sgd.optimizer, sgd.lr, sgd.lr_scaling, sgd.weight_decay) == ("sgd", 0.1, "linear", 5e-4)
    adamw = build_train_config({"arch": "resnet18", "optimizer": "adamw"}, None)
    assert (adamw.lr, adamw.lr_scaling, adamw.weight_decay) == (0.001, "sqrt", 0.05)
    with pytest.raises(Exception, match="invalid --betas: they are AdamW's"):
        build_train_config({"betas": "0.9,0.99"}, None)


FAKE_TIMM = """
from torch import nn

def is_model(name):
    return name == "fake_vit"

def create_model(model_name, num_classes, **kwargs):
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, num_classes))
"""


def test_timm_models_are_built_by_timm_when_it_is_installed(project, refused_in, monkeypatch):
    fake = project / "site"  # stands in for an installed timm
    (fake / "timm").mkdir(parents=True)
    (fake / "timm" / "__init__.py").write_text(textwrap.dedent(FAKE_TIMM))
    monkeypatch.syspath_prepend(str(fake))  # refused_in removes the module afterwards
    built = refused_in(project, "train", "--cpu", "--arch", "timm:fake_vit", "--dry-run", "--json")
    assert built.exit_code == 0, built.output
    assert json.loads(built.stdout)["model_class"] == "torch.nn.modules.container.Sequential"
    unknown = refused_in(project, "train", "--cpu", "--arch", "timm:no_such_net", "--dry-run")
    assert unknown.exit_code == 2, unknown.output
    assert "invalid --arch: timm has no model 'no_such_net'" in unknown.stderr


def test_a_recipe_carries_the_new_settings_and_flags_override_them(tmp_path):
    from ddpcli.config import build_train_config

    recipe = tmp_path / "finetune.toml"
    recipe.write_text(
        textwrap.dedent(
            """
            [train]
            arch = "mymodels:patchnet"
            dataset = "mydata:stripes"
            optimizer = "adamw"
            betas = [0.9, 0.95]
            init_from = "weights.pt"
            reset_head = true
            model_args = { width = 16, act = "relu" }
            """
        )
    )
    cfg = build_train_config({}, recipe)
    assert cfg.model_args == {"width": 16, "act": "relu"} and cfg.betas == [0.9, 0.95]
    assert cfg.init_from == Path("weights.pt") and cfg.reset_head and cfg.custom_dataset
    assert cfg.augment == "auto" and cfg.data_dir is None  # a factory needs no --data-dir
    flagged = build_train_config({"model_args": ["width=8"]}, recipe)
    assert flagged.model_args == {"width": 8}  # the flags' keywords replace the recipe's


def test_the_worked_example_in_the_docs_is_the_shipped_one():
    """docs/custom.md shows examples/custom/*.py in full; they must not drift apart."""
    doc = (REPO / "docs" / "custom.md").read_text()
    for name in ("models.py", "csv_data.py", "make_toy_data.py"):
        source = (REPO / "examples" / "custom" / name).read_text()
        assert f"```python\n{source}```" in doc, name
