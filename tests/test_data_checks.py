"""Data is never silently dropped: image-folder layout checks before start, unreadable images
(one line naming the file, or --skip-bad-images), every PIL mode as RGB, and full training
batches only, with the header saying how many images an epoch trains on."""

from __future__ import annotations

import gc
import json
import shutil
import sys
import warnings

import numpy as np
import pytest
import torch
from conftest import read_metrics, run_cli
from PIL import Image
from test_data import write_image_folder

from ddpcli.config import TrainConfig
from ddpcli.config.plan import RunPlan
from ddpcli.data import layout, sets
from ddpcli.data.device import DeviceResidentBatches
from ddpcli.data.pipeline import DataPipeline
from ddpcli.data.sets import UnreadableImage, load_splits
from ddpcli.dist import DistContext
from ddpcli.errors import USAGE, DdpcliError
from ddpcli.launcher.plan import plan_run


def context(rank: int = 0, world_size: int = 1) -> DistContext:
    return DistContext(rank, rank, world_size, world_size, 0, torch.device("cpu"), "gloo")


def planned(**settings) -> RunPlan:
    """The plan a run of these settings gets (ddpcli.launcher.plan), as its ranks receive it."""
    return plan_run(TrainConfig(**settings), None)


def folder_config(data_dir, out, **overrides) -> RunPlan:
    values = dict(
        dataset="imagefolder", data_dir=data_dir, arch="tinycnn", image_size=16,
        per_gpu_batch=4, epochs=1, cpu=True, nproc=1, workers=0, out=out, seed=3,
    )  # fmt: skip
    values.update(overrides)
    return planned(**values)


def write_garbage(path) -> None:
    path.write_bytes(b"\x89PNG\r\n\x1a\n but not an image")


def in_memory(size: int) -> sets.MemorySplits:
    images = sets.ImageSet(torch.zeros(size, 3, 8, 8, dtype=torch.uint8), torch.arange(size))
    return sets.MemorySplits(images, images, 10, [f"c{i}" for i in range(10)])


def refusal(data_dir) -> str:
    with pytest.raises(DdpcliError) as caught:
        layout.check_imagefolder(data_dir)
    assert caught.value.exit_code == USAGE
    return caught.value.message


# --- The layout, checked before any worker starts -----------------------------------------


def test_a_val_class_that_train_lacks_is_named_before_start(tmp_path, in_process):
    write_image_folder(tmp_path)
    owl = tmp_path / "val" / "owl"
    (tmp_path / "val" / "emu").mkdir()
    owl.rename(tmp_path / "val" / "zebra")  # its images would have no label
    result = in_process(
        "train", "--dataset", "imagefolder", "--data-dir", str(tmp_path), "--dry-run"
    )
    assert result.returncode == 2
    assert "emu, zebra" in result.stderr and "train lacks" in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2 and "Traceback" not in result.stderr


def test_a_train_class_without_images_is_named(tmp_path):
    write_image_folder(tmp_path)
    (tmp_path / "train" / "emu" / "notes").mkdir(parents=True)
    (tmp_path / "train" / "emu" / "notes" / "README.txt").write_text("no images here")
    message = refusal(tmp_path)
    assert "train has class folders with no images: emu;" in message


def test_images_outside_class_folders_and_an_empty_val_are_refused(tmp_path):
    write_image_folder(tmp_path)
    (tmp_path / "train" / "cat" / "0.png").rename(tmp_path / "train" / "stray.png")
    assert "outside any class folder (stray.png)" in refusal(tmp_path)
    (tmp_path / "train" / "stray.png").unlink()
    for image in (tmp_path / "val").rglob("*.png"):
        image.unlink()
    assert "val holds no images" in refusal(tmp_path)


def test_a_sound_layout_passes_and_its_classes_come_from_train(tmp_path):
    write_image_folder(tmp_path)
    shutil.rmtree(tmp_path / "val" / "owl")  # val may lack a class that train has
    assert layout.check_imagefolder(tmp_path) == ["cat", "dog", "owl"]


def test_hidden_folders_and_files_are_neither_classes_nor_images(tmp_path):
    write_image_folder(tmp_path)
    for split in ("train", "val"):  # Jupyter's copies, a repository, macOS's AppleDouble files
        shutil.copytree(tmp_path / split / "cat", tmp_path / split / ".ipynb_checkpoints")
        shutil.copytree(tmp_path / split / "dog", tmp_path / split / "owl" / ".ipynb_checkpoints")
        write_garbage(tmp_path / split / "cat" / "._0.png")
        write_garbage(tmp_path / split / "._stray.png")
    (tmp_path / "train" / ".git").mkdir()
    (tmp_path / "train" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert layout.check_imagefolder(tmp_path) == ["cat", "dog", "owl"]
    samples = layout.folder_samples(tmp_path / "train", ["cat", "dog", "owl"])
    assert [(path.parent.name, path.name) for path, _ in samples][5:8] == [
        ("cat", "5.png"), ("dog", "0.png"), ("dog", "1.png")
    ]  # fmt: skip
    assert len(samples) == 18
    cfg = folder_config(tmp_path, tmp_path / "out")
    data = DataPipeline(load_splits(cfg, context(), True), cfg, context(), True)
    assert data.describe_sizes().endswith(" · 3 classes")


# --- Every mode becomes RGB ------------------------------------------------------------------


def palette_image(transparency) -> Image.Image:
    image = Image.new("P", (5, 4))
    image.putpalette([255, 0, 0, 0, 255, 0] * 128)
    if transparency is not None:
        image.info["transparency"] = transparency
    return image


MODES = {
    "L.png": (lambda: Image.new("L", (5, 4), 77), (77, 77, 77)),
    "LA.png": (lambda: Image.new("LA", (5, 4), (77, 0)), (77, 77, 77)),
    "1.png": (lambda: Image.new("1", (5, 4), 1), (255, 255, 255)),
    "P.png": (lambda: palette_image(None), (255, 0, 0)),
    "P-index.png": (lambda: palette_image(0), (255, 0, 0)),  # alpha dropped, not composited
    "P-bytes.png": (lambda: palette_image(bytes([0, 128])), (255, 0, 0)),
    "RGBA.png": (lambda: Image.new("RGBA", (5, 4), (10, 20, 30, 0)), (10, 20, 30)),
    "CMYK.tif": (lambda: Image.new("CMYK", (5, 4), (255, 0, 0, 0)), (0, 255, 255)),
    "CMYK.jpg": (lambda: Image.new("CMYK", (5, 4), (255, 0, 0, 0)), None),  # lossy
    # 16-bit grey is scaled from its own range (PIL's convert clips it at 255: white).
    "I16.png": (lambda: grey16(128 * 257, np.uint16), (128, 128, 128)),
    "I16B.tif": (lambda: grey16(64 * 257, ">u2"), (64, 64, 64)),
    "I-16-bit.tif": (lambda: grey16(200 * 257, np.int32), (200, 200, 200)),  # older Pillow's
    "I-8-bit.tif": (lambda: grey16(77, np.int32), (77, 77, 77)),
}


def grey16(value: int, dtype) -> Image.Image:
    return Image.fromarray(np.full((4, 5), value, dtype=dtype))


@pytest.mark.parametrize("name", MODES)
def test_each_mode_is_read_as_rgb_without_warnings(tmp_path, name):
    make, pixel = MODES[name]
    path = tmp_path / name
    make().save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL warns on a palette's byte transparency
        image = sets.read_rgb(path)
    assert image.shape == (3, 4, 5) and image.dtype == torch.uint8
    if pixel is not None:
        assert image[:, 0, 0].tolist() == list(pixel)
    else:
        assert image[0].float().mean() < 40 and image[1:].float().mean() > 215  # cyan


def test_grey_beyond_its_range_is_refused_naming_the_range_never_clipped(tmp_path):
    path = tmp_path / "float.tif"
    Image.fromarray(np.full((4, 5), 300.5, dtype=np.float32)).save(path)  # mode F
    with pytest.raises(UnreadableImage) as caught:
        sets.read_rgb(path)
    assert f"cannot decode image {path}: its F pixels run from 300.5 to 300.5, outside 0..255" in (
        caught.value.message
    )


# --- Unreadable images ---------------------------------------------------------------------


def test_an_unreadable_image_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "bad.jpg"
    write_garbage(bad)
    truncated = tmp_path / "truncated.png"
    Image.new("RGB", (64, 64), (1, 2, 3)).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:-40])
    for path in (bad, truncated):
        with pytest.raises(UnreadableImage) as caught:
            sets.read_rgb(path)
        message = caught.value.message
        assert caught.value.exit_code == USAGE and "\n" not in message
        assert (
            message.startswith(f"cannot decode image {path}: ") and "--skip-bad-images" in message
        )


def test_a_dataloader_worker_passes_the_one_line_on(tmp_path):
    # The DataLoader re-raises a worker's exception from its formatted traceback.
    write_image_folder(tmp_path / "imgs", per_class=4)
    bad = tmp_path / "imgs" / "train" / "dog" / "2.png"
    write_garbage(bad)
    cfg = folder_config(tmp_path / "imgs", tmp_path / "out", workers=2)
    data = DataPipeline(load_splits(cfg, context(), False), cfg, context(), False)
    with pytest.raises(UnreadableImage) as caught:
        list(data.train_batches(0))
    assert caught.value.message.startswith(f"cannot decode image {bad}: ")
    assert "\n" not in caught.value.message and "Traceback" not in caught.value.message
    # The error's frames hold the loader: let it stop its workers now, not at this process's
    # exit (there, alone in a pytest process, they kept it from ending).
    del caught
    gc.collect()


@pytest.mark.parametrize("device_resident", [True, False])
def test_skip_bad_images_leaves_them_out_on_both_paths(tmp_path, device_resident):
    write_image_folder(tmp_path / "imgs", per_class=4)
    bad = [
        tmp_path / "imgs" / "train" / "cat" / "1.png",
        tmp_path / "imgs" / "val" / "owl" / "0.png",
    ]
    for path in bad:
        write_garbage(path)
    cfg = folder_config(tmp_path / "imgs", tmp_path / "out", skip_bad_images=True)
    splits = load_splits(cfg, context(), device_resident)
    assert splits.skipped == [str(path) for path in bad]
    data = DataPipeline(splits, cfg, context(), device_resident)
    assert (data.train_size, data.val_size) == (11, 11)
    assert sum(len(labels) for _, labels in data.val_batches()) == 11
    if device_resident:  # a run without the flag must not take the cache that lacks them
        without = folder_config(tmp_path / "imgs", tmp_path / "out")
        with pytest.raises(UnreadableImage, match="1.png"):
            load_splits(without, context(), device_resident)


@pytest.mark.parametrize("device_resident", [True, False])
def test_skip_bad_images_that_empties_a_train_class_is_refused(tmp_path, device_resident):
    write_image_folder(tmp_path / "imgs", per_class=2)
    for index in range(2):
        write_garbage(tmp_path / "imgs" / "train" / "dog" / f"{index}.png")
    cfg = folder_config(tmp_path / "imgs", tmp_path / "out", skip_bad_images=True)
    with pytest.raises(DdpcliError) as caught:
        load_splits(cfg, context(), device_resident)
    assert caught.value.exit_code == USAGE
    train = tmp_path / "imgs" / "train"
    assert caught.value.message.startswith(
        f"--skip-bad-images left no image in {train}'s class dog (2 skipped, first "
        f"{train / 'dog' / '0.png'})"
    )


@pytest.mark.parametrize("data_path", ["device", "loader"])
def test_a_bad_image_ends_the_run_with_exit_2_or_is_skipped_and_reported(tmp_path, data_path):
    write_image_folder(tmp_path / "imgs", per_class=4)
    (tmp_path / "imgs" / "train" / "dog" / "3.png").unlink()
    bad = tmp_path / "imgs" / "train" / "dog" / "3.jpg"
    bad.write_text("notes, renamed .jpg\n")
    settings = [
        "train", "--cpu", "--nproc", "2", "--dataset", "imagefolder", "--data-dir",
        str(tmp_path / "imgs"), "--arch", "tinycnn", "--image-size", "16", "--per-gpu-batch",
        "2", "--epochs", "1", "--data-path", data_path,
    ]  # fmt: skip
    if data_path == "loader":  # the device path has none
        settings += ["--workers", "1"]
    failed = run_cli(*settings, "--out", str(tmp_path / "failed"), timeout=180)
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert f"cannot decode image {bad}" in failed.stderr and "--skip-bad-images" in failed.stderr
    # Rank 1, waiting for rank 0's one decode (device path), leaves without printing its stack.
    assert "Traceback" not in failed.stderr and "Current thread" not in failed.stderr
    # The file's line and the launcher's: not the other rank's lost connection as well.
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and "failed first" in errors[1], errors
    out = tmp_path / "skipped"
    result = run_cli(*settings, "--skip-bad-images", "--out", str(out), "--json", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["skipped_images"] == 1 and summary["skipped_images_first"] == [str(bad)]
    assert json.loads((out / "summary.json").read_text())["skipped_images"] == 1
    assert (out / sets.SKIPPED_IMAGES_FILE).read_text().splitlines() == [str(bad)]
    assert "left out 1 image(s) that cannot be decoded" in result.stderr
    assert read_metrics(out)[0]["val_samples"] == 12


FAILING_PREPARATION = """
import datetime, faulthandler, signal, sys, time
import torch, torch.distributed as dist
import ddpcli.dist
from ddpcli.dist import DistContext, rank_zero_prepares
from ddpcli.errors import usage_error
ddpcli.dist.RANK_ZERO_LEAVES_S = 3.0  # no agent here to stop rank 1 once rank 0 has left
rank, init = int(sys.argv[1]), sys.argv[2]
faulthandler.register(signal.SIGTERM, chain=True)  # as a worker does
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
ctx = DistContext(rank, rank, 2, 2, 0, torch.device("cpu"), "gloo")
start = time.monotonic()
try:
    with rank_zero_prepares(ctx, "decode the folder"):
        if rank == 0:
            raise usage_error("cannot decode image 3.jpg")
except Exception as error:
    stack_on_sigterm = faulthandler.unregister(signal.SIGTERM)
    print(f"{error} after {time.monotonic() - start:.1f}s", stack_on_sigterm, file=sys.stderr)
    print(f"left at {time.time()}", file=sys.stderr)
"""


def left_at(stderr: str) -> float:
    return float(stderr.strip().splitlines()[-1].removeprefix("left at "))


def test_ranks_waiting_for_a_failed_preparation_answer_at_once_and_leave_after_rank_0(tmp_path):
    """Rank 0 says why and its exit status is the job's: a rank that left first, seen first
    by the agent, had rank 0 stopped before it said it. Left waiting without answering,
    they were stopped by the agent after rank 0's exit, and each printed its stack
    (faulthandler) for a wait that was not stuck."""
    from conftest import clean_env
    from test_faults import run_together

    init = f"file://{tmp_path / 'init'}"
    commands = [
        ([sys.executable, "-c", FAILING_PREPARATION, str(rank), init], clean_env())
        for rank in (0, 1)
    ]
    rank0, rank1 = run_together(commands, timeout=60)
    assert rank0.stderr.startswith("cannot decode image 3.jpg after "), rank0.stderr[-2000:]
    said = rank1.stderr.strip().splitlines()[-2]
    assert said.startswith(
        "stopped because another rank failed: rank 0 failed to decode the folder after "
    ), rank1.stderr[-2000:]
    assert said.endswith(" False")  # no stack if the agent's SIGTERM comes now
    assert float(rank0.stderr.split(" after ")[1].split("s")[0]) < 10  # rank 1 answered
    assert left_at(rank1.stderr) - left_at(rank0.stderr) > 2.5  # rank 0 left first


# --- Full training batches only --------------------------------------------------------------


@pytest.mark.parametrize(
    "size,world_size,batch", [(4097, 2, 64), (52, 2, 8), (64, 2, 8), (30, 4, 3), (7, 2, 4)]
)
def test_steps_per_epoch_counts_the_full_batches_each_rank_is_given(size, world_size, batch):
    cfg = planned(per_gpu_batch=batch, image_size=8)
    for rank in range(world_size):
        data = DataPipeline(in_memory(size), cfg, context(rank, world_size), device_resident=True)
        batches = [labels for _, labels in data.train_batches(epoch=1)]
        assert len(batches) == data.steps_per_epoch() == -(-size // world_size) // batch
        assert all(len(labels) == batch for labels in batches)
        resumed = [labels for _, labels in data.train_batches(epoch=1, skip_batches=1)]
        assert [b.tolist() for b in resumed] == [b.tolist() for b in batches[1:]]
        assert sum(len(labels) for _, labels in data.val_batches()) == len(
            range(rank, size, world_size)
        )  # validation keeps every sample


def test_device_batches_drop_only_the_partial_last_one():
    images = sets.ImageSet(torch.zeros(10, 3, 8, 8, dtype=torch.uint8), torch.arange(10))
    cpu = torch.device("cpu")

    def sizes(drop_last: bool) -> list[int]:
        batches = DeviceResidentBatches(
            images, list(range(10)), 4, cpu, [0, 0, 0], [1, 1, 1], "none", 0, 0, False, drop_last
        )
        got = [len(labels) for _, labels in batches]
        assert len(got) == len(batches)
        return got

    assert sizes(drop_last=True) == [4, 4] and sizes(drop_last=False) == [4, 4, 2]


def test_a_batch_larger_than_each_rank_s_share_is_refused():
    cfg = planned(per_gpu_batch=16, image_size=8)
    with pytest.raises(DdpcliError, match="give each 15, less than one batch of 16"):
        DataPipeline(in_memory(30), cfg, context(0, 2), device_resident=True)


@pytest.mark.parametrize(
    "size,batch,words",
    [
        (4097, 64, "4096 of 4097 train images per epoch (last partial batch dropped) / 4097 val"),
        (4096, 64, "4096 train images per epoch / 4096 val images"),
        (7, 4, "7 train images, 8 per epoch (1 repeated to even out the ranks)"),
    ],
)
def test_the_header_says_how_many_images_an_epoch_trains_on(size, batch, words):
    cfg = planned(per_gpu_batch=batch, image_size=8)
    data = DataPipeline(in_memory(size), cfg, context(0, 2), device_resident=True)
    assert data.describe_sizes().startswith(words)


def test_any_set_size_trains_and_the_header_says_what_an_epoch_trains_on(tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train", "--cpu", "--nproc", "2", "--arch", "tinycnn", "--image-size", "8",
        "--synthetic-size", "4097", "--epochs", "1", "--out", str(out), timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4096 of 4097 train images per epoch (last partial batch dropped)" in result.stderr
    assert "32 steps per epoch" in result.stderr and "1024 val images · 10 classes" in result.stderr
    metrics = read_metrics(out)[0]
    assert metrics["step"] == 32 and metrics["val_samples"] == 1024
