"""`ddpcli checkpoint convert --to pt|safetensors|onnx|pt2` and what reads its outputs:
safetensors with its metadata, exports checked against eager PyTorch, `--init-from
model.safetensors`, and the outputs loaded by plain PyTorch and onnxruntime.

A tiny model built in-process serves most tests; one real run (resnet18 at 32 px on a
folder of 39 images) serves the interop tests, `--init-from` and the one ONNX export.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import read_metrics, run_cli
from typer.testing import CliRunner

from ddpcli.checkpoint import export
from ddpcli.checkpoint.safetensors_io import read_safetensors, write_safetensors
from ddpcli.checkpoint.schema import FORMAT
from ddpcli.cli import app
from ddpcli.files import atomic_save, digest_status

CLASSES = ["blue", "green", "red"]
IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A ddpcli checkpoint of tinycnn as an --ema run saves it (the parts convert reads)."""
    from ddpcli.models.build import build_model

    torch.manual_seed(0)
    num_classes = 10
    model = build_model("tinycnn", num_classes)
    payload = {
        "format": FORMAT,
        "model": model.state_dict(),
        "epoch": 1,
        "step": 4,
        "num_classes": num_classes,
        "classes": [f"class{index}" for index in range(num_classes)],
        "normalization": {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.2, 0.2]},
        "config": {"arch": "tinycnn", "image_size": 16, "val_resize_size": 16,
                   "val_crop_size": 16, "dataset": "synthetic", "model_args": {}},
    }  # fmt: skip
    # AveragedModel's layout: the module's keys under `module.`, and its counter.
    averaged = {f"module.{key}": value * 0.9 for key, value in model.state_dict().items()}
    payload["ema"] = {**averaged, "n_averaged": torch.tensor(3)}
    path = tmp_path_factory.mktemp("tiny") / "best.pt"
    atomic_save(payload, path)
    return path


# --- safetensors ---------------------------------------------------------------------------


def test_safetensors_round_trip_keeps_weights_and_metadata(tmp_path):
    state = {"fc.weight": torch.randn(3, 4), "fc.bias": torch.zeros(3)}
    metadata = {"arch": "resnet18", "classes": CLASSES, "image_size": 32, "model_args": {"a": 1},
                **IMAGENET}  # fmt: skip
    digest = write_safetensors(tmp_path / "m.safetensors", state, metadata)
    read_state, read_metadata = read_safetensors(tmp_path / "m.safetensors")
    assert read_state.keys() == state.keys()
    assert all(torch.equal(read_state[key], state[key]) for key in state)
    assert read_metadata == {**metadata, "num_classes": 3}
    assert digest_status(tmp_path / "m.safetensors") == {
        "status": "ok", "sha256": digest, "recorded": digest
    }  # fmt: skip
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed, not left


def test_convert_to_safetensors_keeps_ema_weights_arch_classes_and_preprocessing(
    checkpoint, tmp_path
):
    out = tmp_path / "model.safetensors"  # --to read from the suffix
    result = invoke("checkpoint", "convert", str(checkpoint), str(out), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["weights"] == "ema"
    state, metadata = read_safetensors(out)
    saved = torch.load(checkpoint, weights_only=True)
    assert torch.equal(state["fc.weight"], saved["ema"]["module.fc.weight"])
    assert "n_averaged" not in state
    assert metadata["arch"] == "tinycnn" and metadata["num_classes"] == 10
    assert metadata["classes"] == saved["classes"]
    verified = invoke("checkpoint", "verify", str(out), "--json")
    assert verified.exit_code == 0, verified.output
    model_check = next(c for c in json.loads(verified.stdout)["checks"] if c["check"] == "model")
    assert model_check["status"] == "pass", model_check
    assert model_check["detail"].startswith("tinycnn(num_classes=10) accepts all"), model_check
    inspected = invoke("checkpoint", "inspect", str(out), "--json")  # read as safetensors
    assert inspected.exit_code == 0, inspected.output
    report = json.loads(inspected.stdout)
    assert (report["kind"], report["arch"], report["num_classes"]) == ("safetensors", "tinycnn", 10)
    assert report["model"]["tensors"] == len(state) and report["classes"] == saved["classes"]
    shown = invoke("checkpoint", "inspect", str(out))
    assert shown.exit_code == 0 and "safetensors file" in shown.output, shown.output
    assert (metadata["mean"], metadata["std"]) == ([0.5, 0.4, 0.3], [0.2, 0.2, 0.2])
    assert (metadata["image_size"], metadata["val_resize_size"], metadata["val_crop_size"]) == (
        16, 16, 16
    )  # fmt: skip
    raw = invoke("checkpoint", "convert", str(checkpoint), str(tmp_path / "raw.safetensors"),
                 "--weights", "raw")  # fmt: skip
    assert raw.exit_code == 0, raw.output
    raw_state, _ = read_safetensors(tmp_path / "raw.safetensors")
    assert torch.equal(raw_state["fc.weight"], saved["model"]["fc.weight"])


def test_an_existing_out_is_kept_unless_overwrite_is_given(checkpoint, tmp_path):
    """`convert best.pt last.pt` by mistake must not turn a resumable checkpoint into a state
    dict: OUT that exists is exit 2 (a pt copy or an export alike); --overwrite replaces it."""
    for name in ("last.pt", "model.safetensors"):
        out = tmp_path / name
        out.write_bytes(b"a resumable checkpoint")
        refused = invoke("checkpoint", "convert", str(checkpoint), str(out))
        assert refused.exit_code == 2, refused.output
        assert f"{out} exists" in refused.output and "--overwrite" in refused.output
        assert out.read_bytes() == b"a resumable checkpoint"
        replaced = invoke("checkpoint", "convert", str(checkpoint), str(out), "--overwrite")
        assert replaced.exit_code == 0, replaced.output
        assert out.read_bytes() != b"a resumable checkpoint"


def test_a_suffix_that_contradicts_to_is_exit_2(checkpoint, tmp_path):
    result = invoke("checkpoint", "convert", str(checkpoint), str(tmp_path / "m.onnx"),
                    "--to", "pt2")  # fmt: skip
    assert result.exit_code == 2
    assert "OUT's suffix .onnx says onnx, --to says pt2; name it m.pt2" in result.output


# --- Exports checked against eager PyTorch ---------------------------------------------------


def test_convert_to_pt2_is_checked_against_eager_on_batches_of_1_and_n(checkpoint, tmp_path):
    out = tmp_path / "model.pt2"
    result = invoke("checkpoint", "convert", str(checkpoint), str(out))
    assert result.exit_code == 0, result.output
    assert re.search(
        r"checked against eager PyTorch: batch 1 max abs diff \S+, batch 4 max abs diff \S+ "
        r"\(tolerance 0.0001\); input \(batch, 3, 16, 16\)",
        result.output,
    ), result.output
    program = torch.export.load(str(out)).module()
    assert program(torch.zeros(7, 3, 16, 16)).shape == (7, 10)  # the batch axis is dynamic
    assert_eval_names_what_it_reads(out, "a torch.export program")


def assert_eval_names_what_it_reads(exported: Path, kind: str) -> None:
    """An export handed to `ddpcli eval` is not called corrupt: exit 2 says what it is, what
    eval reads, and what to use."""
    result = invoke("eval", str(exported), "--cpu", "--nproc", "1")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert f"is {kind}" in lines[0] and "corrupt" not in lines[0], lines[0]
    assert ".safetensors" in lines[0] and "--to safetensors" in lines[0], lines[0]


def test_an_export_that_differs_from_eager_is_exit_1_and_writes_nothing(
    checkpoint, tmp_path, monkeypatch
):
    real_runner = export.exported_runner

    def tampered(to, file):
        run = real_runner(to, file)
        return lambda images: run(images) + 1e-3

    monkeypatch.setattr(export, "exported_runner", tampered)
    out = tmp_path / "model.pt2"
    result = invoke("checkpoint", "convert", str(checkpoint), str(out))
    assert result.exit_code == 1
    assert "differs from eager PyTorch by 0.001" in result.output
    assert "past the tolerance 0.0001" in result.output
    assert not out.exists() and not list(tmp_path.iterdir())


def test_an_import_path_named_only_in_the_file_is_never_imported(checkpoint, tmp_path):
    """A safetensors file runs nothing, but the arch it names is code: not on its say."""
    marker = tmp_path / "IMPORTED"
    factory = tmp_path / "evil.py"
    factory.write_text(f"open({str(marker)!r}, 'w')\ndef build(num_classes): pass\n")
    weights = tmp_path / "evil.safetensors"
    state = torch.load(checkpoint, weights_only=True)["model"]
    write_safetensors(weights, state, {"arch": f"{factory}:build", "num_classes": 10})
    result = invoke("checkpoint", "convert", str(weights), str(tmp_path / "m.pt2"))
    assert result.exit_code == 2
    assert "code that is not run on its say; pass --arch" in result.output
    assert not marker.exists()


@pytest.mark.parametrize(("out", "missing"), [("m.safetensors", "safetensors"),
                                              ("m.onnx", "onnxruntime")])  # fmt: skip
def test_missing_export_extra_is_exit_2_naming_it(checkpoint, tmp_path, monkeypatch, out, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # `import` fails, as without the extra
    result = invoke("checkpoint", "convert", str(checkpoint), str(tmp_path / out))
    assert result.exit_code == 2
    assert f"needs the {missing} package" in result.output
    assert "pip install 'ddpcli[export]'" in result.output
    assert not (tmp_path / out).exists()


# --- Fine-tuning from a safetensors file ------------------------------------------------------


def test_init_from_safetensors_naming_other_classes_needs_reset_head(checkpoint, tmp_path):
    """Its header names 3 classes; the synthetic set has 10: the line says which, before any
    shape is compared. (A run from a safetensors file trains in `trained` below.)"""
    three = tmp_path / "three.safetensors"
    state = torch.load(checkpoint, weights_only=True)["model"]
    write_safetensors(three, state, {"arch": "tinycnn", "classes": CLASSES})
    tiny = ["--cpu", "--nproc", "1", "--arch", "tinycnn", "--image-size", "16", "--dry-run"]
    refused = invoke("train", *tiny, "--init-from", str(three))
    assert refused.exit_code == 2, refused.output
    assert "was trained on 3 classes (blue, green, red), this data set has 10" in refused.output
    assert "add --reset-head" in refused.output
    accepted = invoke("train", *tiny, "--init-from", str(three), "--reset-head")
    assert accepted.exit_code == 0, accepted.output


# --- Interop: plain PyTorch and onnxruntime ----------------------------------------------------


def write_colour_folder(root: Path) -> None:
    """32 px PNGs whose class is their dominant colour, in ImageFolder's layout."""
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    for split, per_class in (("train", 8), ("val", 5)):
        for channel, name in enumerate(reversed(CLASSES)):  # red, green, blue
            (root / split / name).mkdir(parents=True)
            for index in range(per_class):
                pixels = torch.randint(0, 120, (32, 32, 3), dtype=torch.uint8, generator=generator)
                pixels[..., channel] += 120
                Image.fromarray(pixels.numpy()).save(root / split / name / f"{index}.png")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Any]:
    """One real run of resnet18 on the colour folder, fine-tuned from a safetensors file
    (`--init-from`), its best.pt converted to pt, safetensors and onnx."""
    import torchvision

    root = tmp_path_factory.mktemp("interop")
    write_colour_folder(root / "data")
    torch.manual_seed(0)
    start = torchvision.models.resnet18(num_classes=3).state_dict()
    write_safetensors(root / "start.safetensors", start, {"arch": "resnet18", "classes": CLASSES})
    result = run_cli(
        "train", "--cpu", "--nproc", "1", "--dataset", "imagefolder", "--data-dir",
        str(root / "data"), "--arch", "resnet18", "--image-size", "32", "--val-resize-size",
        "32", "--data-path", "loader", "--workers", "0", "--epochs", "1", "--per-gpu-batch",
        "8", "--init-from", str(root / "start.safetensors"), "--out", str(root / "run"),
        timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    best = root / "run" / "checkpoints" / "best.pt"
    paths: dict[str, Any] = {"data": root / "data", "run": root / "run", "best": best,
                             "train_log": result.stderr}  # fmt: skip
    for to in ("pt", "safetensors", "onnx"):
        paths[to] = root / f"model.{to}"
        converted = invoke("checkpoint", "convert", str(best), str(paths[to]), "--json")
        assert converted.exit_code == 0, converted.output
        paths[f"{to}_report"] = json.loads(converted.stdout)
    return paths


def test_train_starts_from_a_safetensors_file(trained):
    start = Path(trained["run"]).parent / "start.safetensors"
    assert f"--init-from {start}: loaded 122 tensors of resnet18" in trained["train_log"]
    assert read_metrics(trained["run"])[-1]["epoch"] == 1


def val_images(data: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The folder's val split as a user loads it without ddpcli: torchvision's ImageFolder
    and transforms (the images are 32 px already: the view only normalises)."""
    import torchvision
    from torchvision import transforms

    view = transforms.Compose([transforms.ToTensor(), transforms.Normalize(**IMAGENET)])
    folder = torchvision.datasets.ImageFolder(str(data / "val"), transform=view)
    return torch.stack([image for image, _ in folder]), torch.tensor(folder.targets)


def plain_pytorch_logits(state_file: Path, images: torch.Tensor) -> torch.Tensor:
    import torchvision

    model = torchvision.models.resnet18(num_classes=3)
    model.load_state_dict(torch.load(state_file, weights_only=True))
    model.eval()
    with torch.no_grad():
        return model(images)


def test_plain_pt_loads_into_torchvision_and_scores_as_ddpcli_eval(trained, monkeypatch):
    """Plain PyTorch on the `pt` file, `ddpcli eval` on the safetensors file and the run's
    own validation: one top-1, image for image. The eval is a world of 1 in this process, as
    a rank that torchrun started (no interpreter and torch import of its own)."""
    images, labels = val_images(trained["data"])
    logits = plain_pytorch_logits(trained["pt"], images)
    correct = int((logits.argmax(1) == labels).sum())
    for variable, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(variable, value)
    result = invoke(
        "eval", str(trained["safetensors"]), "--data-dir", str(trained["data"]), "--cpu",
        "--nproc", "1", "--json", "--out", str(trained["run"] / "eval"),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout)
    assert figures["samples"] == len(labels) == 15
    assert figures["top1"] == pytest.approx(correct / 15, abs=1e-9)
    assert read_metrics(trained["run"])[-1]["val_acc"] == pytest.approx(correct / 15, abs=1e-9)


def test_onnx_export_runs_in_onnxruntime_and_agrees_with_eager(trained):
    import onnxruntime

    report = trained["onnx_report"]
    assert [check["batch"] for check in report["checks"]] == [1, 4]
    assert report["max_abs_diff"] <= 1e-4
    images, _ = val_images(trained["data"])
    logits = plain_pytorch_logits(trained["pt"], images)
    session = onnxruntime.InferenceSession(str(trained["onnx"]), providers=["CPUExecutionProvider"])
    (onnx_logits,) = session.run(None, {"images": images.numpy()})
    assert onnx_logits.shape == (15, 3)  # a batch of 15: the axis is dynamic
    assert (torch.from_numpy(onnx_logits) - logits).abs().max().item() < 1e-4
    assert torch.equal(torch.from_numpy(onnx_logits).argmax(1), logits.argmax(1))
    assert_eval_names_what_it_reads(trained["onnx"], "an ONNX model")
