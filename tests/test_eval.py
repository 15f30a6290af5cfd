"""`ddpcli eval`: a trained run's checkpoint measured again gives the run's own figure, the
same figures at worlds 1, 2 and 3 (23 images: no world divides them), the eval folder's
files; bad inputs are exit 2 with one line. One training run serves every test."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import read_metrics, run_cli
from PIL import Image
from typer.testing import CliRunner

from ddpcli.cli import app
from ddpcli.evaluation.data import dealt_batches
from ddpcli.evaluation.metrics import Outcomes, most_confused, summarize
from ddpcli.evaluation.picture import write_confusion_png

CLASSES = ["cat", "dog", "owl"]
VAL_COUNTS = (8, 8, 7)  # 23 images: worlds 2 and 3 both leave a remainder


def write_folder(root: Path) -> None:
    """Three classes of 16 px images, each class its own brightness under noise."""
    generator = torch.Generator().manual_seed(0)
    for split, counts in (("train", (8, 8, 8)), ("val", VAL_COUNTS)):
        for name, count, level in zip(CLASSES, counts, (40, 128, 215), strict=True):
            (root / split / name).mkdir(parents=True)
            for index in range(count):
                noise = torch.randint(-40, 40, (16, 16, 3), generator=generator)
                pixels = (noise + level).clamp(0, 255).to(torch.uint8)
                Image.fromarray(pixels.numpy()).save(root / split / name / f"{index}.png")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """Two ranks, two epochs, with --ema (best.pt follows the EMA's accuracy)."""
    root = tmp_path_factory.mktemp("eval")
    data, out = root / "data", root / "run"
    write_folder(data)
    result = run_cli(
        "train", "--dataset", "imagefolder", "--data-dir", str(data), "--cpu", "--nproc", "2",
        "--arch", "tinycnn", "--image-size", "16", "--per-gpu-batch", "4", "--epochs", "2",
        "--ema", "--ema-steps", "1", "--out", str(out), timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return {"root": root, "data": data, "run": out, "best": out / "checkpoints" / "best.pt"}


def evaluate(
    trained: dict[str, Path], nproc: int, *flags: str, monkeypatch=None, name: str = "best"
) -> dict:
    """`ddpcli eval --json` at NPROC processes; a world of 1 in this process, as a rank that
    torchrun started (the path an outside launcher takes: no process of its own to start)."""
    out = trained["root"] / f"eval-{name}-{nproc}{''.join(flags)}"
    args = [
        "eval", str(trained["run"] / "checkpoints" / f"{name}.pt"), "--data-dir",
        str(trained["data"]), "--cpu", "--nproc", str(nproc), "--json", "--out", str(out), *flags,
    ]  # fmt: skip
    if nproc == 1:
        for variable, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(variable, value)
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.stderr[-3000:]
        return json.loads(result.stdout)
    completed = run_cli(*args, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout)


def test_eval_gives_the_runs_own_figure_and_the_same_figures_at_worlds_1_2_3(trained, monkeypatch):
    reports = {nproc: evaluate(trained, nproc, "--predictions") for nproc in (2, 3)}
    reports[1] = evaluate(trained, 1, "--predictions", monkeypatch=monkeypatch)
    one = reports[1]
    # The run's own validation of the weights best.pt holds (the EMA's: the default).
    best_row = max(read_metrics(trained["run"]), key=lambda row: row["ema_val_acc"])
    assert one["weights"] == "ema" and one["samples"] == 23 and one["top5"] is None
    assert one["top1"] == best_row["ema_val_acc"]
    assert one["loss"] == pytest.approx(best_row["ema_val_loss"], rel=1e-5)
    assert [row["support"] for row in one["per_class"]] == list(VAL_COUNTS)
    figures = ("top1", "top5", "loss", "samples", "per_class", "macro_f1", "classes")
    for nproc in (2, 3):
        assert reports[nproc]["world_size"] == nproc
        assert {key: reports[nproc][key] for key in figures} == {key: one[key] for key in figures}
        for name in ("per_class.csv", "confusion.csv", "predictions.csv"):
            mine, theirs = Path(reports[nproc]["out"]) / name, Path(one["out"]) / name
            assert mine.read_bytes() == theirs.read_bytes(), name
    out = Path(one["out"])
    assert json.loads((out / "metrics.json").read_text())["top1"] == one["top1"]
    assert (out / "confusion.png").read_bytes()[:4] == b"\x89PNG"
    predictions = (out / "predictions.csv").read_text().splitlines()
    assert predictions[0].startswith("image,label,correct,top1,prob1")
    assert len(predictions) == 24 and predictions[1].split(",")[1] == "cat"
    assert predictions[1].startswith(str(trained["data"] / "val" / "cat"))
    confusion = (out / "confusion.csv").read_text().splitlines()
    assert confusion[0] == "true \\ predicted,cat,dog,owl"
    # The last epoch's raw weights against its raw figure: every rank validated the saved
    # model (rank 0's BatchNorm statistics), so the run's figure is the file's.
    raw = evaluate(trained, 1, "--weights", "raw", monkeypatch=monkeypatch, name="last")
    last_row = read_metrics(trained["run"])[-1]
    assert raw["weights"] == "raw" and raw["top1"] == last_row["val_acc"]
    assert raw["run"]["val_acc"] == last_row["val_acc"]


@pytest.mark.gpu
def test_eval_on_a_gpu_counts_every_image_and_agrees_with_the_cpu(trained):
    """NCCL's gather of the outcomes, CUDA batches; fp32 on both sides (TF32 on the GPU)."""
    figures = {}
    for device in (["--gpus", "0"], ["--cpu", "--nproc", "1"]):
        out = trained["root"] / f"eval-{device[0]}"
        result = run_cli(
            "eval", str(trained["best"]), "--data-dir", str(trained["data"]), *device,
            "--precision", "fp32", "--json", "--out", str(out), timeout=180,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        figures[device[0]] = json.loads(result.stdout)
    gpu, cpu = figures["--gpus"], figures["--cpu"]
    assert gpu["device"] == "cuda" and gpu["samples"] == cpu["samples"] == 23
    assert abs(gpu["top1"] - cpu["top1"]) <= 1 / 23 and gpu["loss"] == pytest.approx(
        cpu["loss"], rel=1e-2
    )


def test_checkpoints_record_the_class_names_and_inspect_shows_them(trained):
    result = CliRunner().invoke(app, ["checkpoint", "inspect", str(trained["best"]), "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["classes"] == CLASSES
    table = CliRunner().invoke(app, ["checkpoint", "inspect", str(trained["best"])])
    assert "cat, dog, owl" in table.stderr


def one_line_exit_2(*args: str) -> str:
    result = CliRunner().invoke(app, ["eval", *args, "--cpu", "--nproc", "1"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, result.stderr + result.stdout
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_bad_inputs_are_exit_2_with_one_line(trained, tmp_path):
    best, data = str(trained["best"]), trained["data"]
    other = tmp_path / "other"
    for name in (*CLASSES, "zebra"):  # a class the checkpoint does not know
        (other / "val" / name).mkdir(parents=True)
        Image.new("RGB", (16, 16)).save(other / "val" / name / "0.png")
    line = one_line_exit_2(best, "--data-dir", str(other))
    assert "zebra" in line and "classes" in line
    run = trained["run"]  # the run's folder, passed for its checkpoint: both are named
    line = one_line_exit_2(str(run), "--data-dir", str(data))
    assert line == (
        f"error: checkpoint {run} is a folder; give a checkpoint file: "
        f"{run}/checkpoints/best.pt or {run}/checkpoints/last.pt"
    )
    not_a_checkpoint = tmp_path / "notes.pt"
    torch.save({"notes": [1, 2, 3]}, not_a_checkpoint)
    line = one_line_exit_2(str(not_a_checkpoint), "--data-dir", str(data))
    assert "not a ddpcli checkpoint or a plain state dict" in line
    line = one_line_exit_2(best, "--data-dir", str(data), "--arch", "smallcnn")
    assert "do not fit --arch smallcnn" in line and "is [8, 3, 3, 3] in the file" in line
    plain = tmp_path / "plain.pt"
    payload = torch.load(trained["best"], weights_only=True)
    torch.save(payload["model"], plain)
    assert "names no architecture" in one_line_exit_2(str(plain), "--data-dir", str(data))
    line = one_line_exit_2(str(plain), "--data-dir", str(data), "--arch", "tinycnn",
                           "--weights", "ema")  # fmt: skip
    assert "--weights ema" in line and "holds no EMA" in line
    payload["config"]["arch"] = "evil_module:build"  # code the file names: not imported
    foreign = tmp_path / "foreign.pt"
    torch.save(payload, foreign)
    line = one_line_exit_2(str(foreign), "--data-dir", str(data))
    assert "evil_module:build" in line and "--arch evil_module:build" in line


def test_a_plain_state_dict_of_other_classes_than_the_folders_says_both_counts(trained, tmp_path):
    """The weights' classifier has 3 outputs, the folder 2 classes: the classes differ, not
    the architecture (--arch tinycnn is right)."""
    two = tmp_path / "two"
    for name in CLASSES[:2]:
        (two / "val" / name).mkdir(parents=True)
        Image.new("RGB", (16, 16)).save(two / "val" / name / "0.png")
    plain = tmp_path / "plain.pt"
    torch.save(torch.load(trained["best"], weights_only=True)["model"], plain)
    line = one_line_exit_2(str(plain), "--data-dir", str(two), "--arch", "tinycnn")
    assert "has 2 classes (cat, dog)" in line and "the weights' classifier 3" in line, line
    assert "--arch" not in line, line


def test_a_class_name_with_a_newline_is_quoted_in_the_error_and_the_table(trained, tmp_path):
    other = tmp_path / "other"
    for name in (*CLASSES, "ze\nbra"):
        (other / "val" / name).mkdir(parents=True)
        Image.new("RGB", (16, 16)).save(other / "val" / name / "0.png")
    line = one_line_exit_2(str(trained["best"]), "--data-dir", str(other))
    assert "'ze\\nbra' is not among its 3" in line, line
    from rich.console import Console

    from ddpcli.cli.eval import per_class_table

    rows = [{"class": name, "precision": 0.5, "recall": 0.5, "f1": 0.5, "support": 1}
            for name in ("cat", "ze\nbra")]  # fmt: skip
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(per_class_table(rows))
    lines = console.export_text().splitlines()
    assert any("'ze\\nbra'" in row and "50.00%" in row for row in lines), lines
    assert not any(row.strip("│ ").startswith("bra") for row in lines), lines


def test_an_eval_into_an_earlier_evals_folder_leaves_none_of_its_files(trained, monkeypatch):
    """--out reused without --predictions: the earlier predictions.csv is removed (it would
    sit beside figures it is not of), and the line says so."""
    for variable, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(variable, value)
    out = trained["root"] / "eval-reused"
    args = ["eval", str(trained["best"]), "--data-dir", str(trained["data"]), "--cpu",
            "--json", "--out", str(out)]  # fmt: skip
    first = CliRunner().invoke(app, [*args, "--predictions"])
    assert first.exit_code == 0, first.stderr
    assert (out / "predictions.csv").is_file()
    second = CliRunner().invoke(app, args)
    assert second.exit_code == 0, second.stderr
    assert not (out / "predictions.csv").exists()
    assert "predictions" not in json.loads(second.stdout)["files"]
    assert f"removed {out / 'predictions.csv'}" in second.stderr, second.stderr


def test_fixed_batches_deal_every_image_once_at_any_world():
    for size in (0, 1, 7, 23, 64, 101):
        for world in (1, 2, 3, 5):
            dealt = [
                index
                for rank in range(world)
                for batch in dealt_batches(size, 4, world, rank)
                for index in batch
            ]
            assert sorted(dealt) == list(range(size)), (size, world)
    # Each image's batch is the same whatever the world: the same neighbours, the same logits.
    batches = {tuple(b) for r in range(3) for b in dealt_batches(23, 4, 3, r)}
    assert batches == {tuple(b) for b in dealt_batches(23, 4, 1, 0)}


def test_figures_from_outcomes():
    labels = np.array([0, 1, 2, 3, 4, 5, 0, 1])
    firsts = [[0, 1, 2, 3, 4], [2, 1, 0, 3, 4], [2, 0, 1, 3, 4], [0, 1, 2, 4, 5]]
    top = np.array([*firsts, [4, 0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [1, 0, 2, 3, 4]])
    outcomes = Outcomes(np.arange(8), labels, top, np.full((8, 5), 0.2, np.float32),
                        np.full(8, 0.5, np.float32))  # fmt: skip
    classes = [f"c{i}" for i in range(6)]
    document, matrix = summarize(outcomes, classes)
    assert document["top1"] == 5 / 8 and document["top5"] == 6 / 8 and document["loss"] == 0.5
    cat = document["per_class"][0]
    assert (cat["precision"], cat["recall"], cat["support"]) == (2 / 4, 1.0, 2)
    assert document["per_class"][5]["precision"] is None  # never predicted
    assert matrix.sum() == 8 and most_confused(matrix, classes, 2) == [
        ("c1", "c2", 1), ("c3", "c0", 1)
    ]  # fmt: skip


def test_the_confusion_picture_at_1000_classes_shows_the_most_confused_pairs(tmp_path):
    rng = np.random.default_rng(0)
    classes = [f"n{index:08d}_class_with_a_long_name" for index in range(1000)]
    labels = np.repeat(np.arange(1000), 5)
    predicted = np.where(rng.random(5000) < 0.7, labels, rng.integers(0, 1000, 5000))
    predicted[:5] = 7  # every image of class 0 taken for class 7
    matrix = np.zeros((1000, 1000), np.int64)
    np.add.at(matrix, (labels, predicted), 1)
    path = tmp_path / "confusion.png"
    write_confusion_png(matrix, classes, path, "1000 classes")
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert most_confused(matrix, classes, 1)[0][:2] == (classes[0], classes[7])


def test_equal_scores_count_the_lowest_class_first_as_training_does():
    """A model that scores every class the same (collapsed) predicts class 0, as argmax."""
    from torch import nn

    from ddpcli.evaluation.rank import measure

    model = nn.Linear(3, 4)
    nn.init.zeros_(model.weight), nn.init.zeros_(model.bias)
    batches = [(torch.ones(5, 3), torch.tensor([0, 1, 2, 3, 0]))]
    outcomes = measure(model, batches, [[0, 1, 2, 3, 4]], 4, "fp32", torch.device("cpu"))
    assert outcomes.top_classes.tolist() == [[0, 1, 2, 3]] * 5
    assert outcomes.top_probs[0].tolist() == [0.25] * 4


def test_a_safetensors_export_is_measured_as_its_checkpoint(trained, monkeypatch):
    """`checkpoint convert` keeps the EMA's weights, the classes and the view in the header."""
    exported = trained["root"] / "model.safetensors"
    converted = CliRunner().invoke(
        app, ["checkpoint", "convert", str(trained["best"]), str(exported)]
    )
    assert converted.exit_code == 0, converted.stderr
    for variable, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(variable, value)
    # The header keeps the run's precision and batch: no flag needed to measure as it did.
    precision = json.loads((trained["run"] / "config.json").read_text())["precision"]
    out = trained["root"] / "eval-safetensors"
    args = ["eval", str(exported), "--data-dir", str(trained["data"]), "--cpu", "--json",
            "--out", str(out)]  # fmt: skip
    report = json.loads(CliRunner().invoke(app, args).stdout)
    assert report["precision"] == precision
    best_row = max(read_metrics(trained["run"]), key=lambda row: row["ema_val_acc"])
    assert report["weights"] == "ema" and report["classes"] == CLASSES
    assert report["top1"] == best_row["ema_val_acc"]


def test_packed_shards_are_measured_as_their_folder_at_any_world(trained, monkeypatch):
    """The val folder packed into shards (3 of them, in packing's shuffled order), given as
    --data-dir (picked as shards by its index.json): every image once, the same figures as
    the folder's at world 1 and 2 (the loss to float rounding: other images share a batch)."""
    packed = trained["root"] / "packed"
    result = CliRunner().invoke(
        app, ["data", "pack", str(trained["data"]), str(packed), "--shard-size", "4KB"]
    )
    assert result.exit_code == 0, result.stderr[-2000:]
    folder = evaluate(trained, 1, monkeypatch=monkeypatch, name="best")
    shards = {}
    for nproc in (1, 2):
        data = {**trained, "data": packed}
        shards[nproc] = evaluate(data, nproc, "--predictions", monkeypatch=monkeypatch)
    for report in shards.values():
        assert report["samples"] == 23 and report["classes"] == CLASSES
        assert report["top1"] == folder["top1"]
        assert report["per_class"] == folder["per_class"]
        assert report["loss"] == pytest.approx(folder["loss"], rel=1e-5)
    names = (Path(shards[2]["out"]) / "predictions.csv").read_text().splitlines()[1:]
    assert len(names) == 23 and names[0].startswith("val-000000.tar#0,")
