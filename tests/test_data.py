"""Data: the STL-10 binary reader, image folders, sharding and augmentation."""

import json

import numpy as np
import pytest
import torch
from conftest import run_cli
from torch.utils.data import DistributedSampler

from ddpcli.data import augment, device, pipeline, sets
from ddpcli.dist import DistContext


def context(rank: int, world_size: int) -> DistContext:
    return DistContext(rank, rank, world_size, world_size, 0, torch.device("cpu"), "gloo")


def write_stl10(root, train_count=40, test_count=21, seed=0):
    """A tiny set in the official layout: channel-major, each channel column-major."""
    rng = np.random.default_rng(seed)
    folder = root / "stl10_binary"
    folder.mkdir(parents=True)
    images = {}
    for split, count in (("train", train_count), ("test", test_count)):
        labels = rng.integers(0, 10, count)
        pixels = np.zeros((count, 3, 96, 96), dtype=np.uint8)
        for index, label in enumerate(labels):  # learnable: the label sets the colour
            pixels[index, label % 3] = 40 + 20 * label
        pixels[:, :, 0, :10] = 255  # a marker on the top row, left side: tests orientation
        pixels.transpose(0, 1, 3, 2).tofile(folder / f"{split}_X.bin")
        (labels + 1).astype(np.uint8).tofile(folder / f"{split}_y.bin")
        images[split] = (pixels, labels)
    (folder / "class_names.txt").write_text("\n".join(f"c{i}" for i in range(10)))
    return images


def test_stl10_reader_keeps_orientation_and_labels(tmp_path):
    written = write_stl10(tmp_path)
    read = sets.read_stl10_split(tmp_path / "stl10_binary", "train")
    pixels, labels = written["train"]
    assert read.images.shape == (40, 3, 96, 96) and read.images.dtype == torch.uint8
    assert torch.equal(read.images, torch.from_numpy(pixels))
    assert read.images[0, 0, 0, :10].eq(255).all()  # top row, not left column
    assert torch.equal(read.labels, torch.from_numpy(labels))


def test_truncated_stl10_is_a_usage_error(tmp_path):
    write_stl10(tmp_path)
    images = tmp_path / "stl10_binary" / "train_X.bin"
    images.write_bytes(images.read_bytes()[:-100])
    result = run_cli(
        "train", "--cpu", "--dataset", "stl10", "--data-dir", str(tmp_path), "--arch",
        "tinycnn", "--nproc", "1", "--out", str(tmp_path / "o"), timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "truncated" in result.stderr and "Traceback" not in result.stderr


def test_stl10_without_files_asks_for_download(tmp_path, in_process):
    result = in_process("train", "--dataset", "stl10", "--data-dir", str(tmp_path), "--dry-run")
    assert result.returncode == 2
    assert "--download" in result.stderr


def test_train_on_tiny_stl10(tmp_path):
    write_stl10(tmp_path)
    out = tmp_path / "out"
    result = run_cli(
        "train", "--cpu", "--nproc", "2", "--dataset", "stl10", "--data-dir", str(tmp_path),
        "--arch", "tinycnn", "--image-size", "24", "--per-gpu-batch", "8", "--epochs", "1",
        "--out", str(out), timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["val_samples"] == 21


def write_image_folder(root, per_class=6, classes=("cat", "dog", "owl")):
    from PIL import Image

    for split in ("train", "val"):
        for label, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for index in range(per_class):
                image = torch.zeros(3, 20, 28, dtype=torch.uint8)
                image[label] = 200
                image[:, :, index] = 255
                Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"{index}.png")


@pytest.mark.parametrize("data_path", ["device", "loader"])
def test_train_on_tiny_image_folder(tmp_path, data_path):
    write_image_folder(tmp_path / "imgs")
    out = tmp_path / "out"
    result = run_cli(
        "train", "--cpu", "--nproc", "2", "--dataset", "imagefolder", "--data-dir",
        str(tmp_path / "imgs"), "--arch", "tinycnn", "--image-size", "16", "--per-gpu-batch",
        "4", "--epochs", "1", "--data-path", data_path, "--workers", "0", "--out", str(out),
        timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["val_samples"] == 18


def test_image_folder_layout_is_checked_before_start(tmp_path, in_process):
    (tmp_path / "train" / "a").mkdir(parents=True)
    result = in_process(
        "train", "--dataset", "imagefolder", "--data-dir", str(tmp_path), "--dry-run"
    )
    assert result.returncode == 2
    assert "val" in result.stderr and "missing" in result.stderr


@pytest.mark.parametrize("size,world_size", [(21, 2), (10, 3), (7, 4)])
def test_validation_shards_cover_each_sample_once(size, world_size):
    seen = [
        i for rank in range(world_size) for i in pipeline.val_shard(size, context(rank, world_size))
    ]
    assert sorted(seen) == list(range(size))


def test_train_shard_is_distributed_sampler_order_and_changes_per_epoch():
    ctx = context(1, 2)
    sampler = DistributedSampler(range(11), num_replicas=2, rank=1, shuffle=True, seed=5)
    sampler.set_epoch(3)
    assert pipeline.train_shard(11, ctx, seed=5, epoch=3) == list(sampler)
    assert pipeline.train_shard(11, ctx, 5, 3) != pipeline.train_shard(11, ctx, 5, 4)


def test_synthetic_set_is_deterministic_from_the_seed():
    first = sets.synthetic_splits(64, 16, seed=1)
    again = sets.synthetic_splits(64, 16, seed=1)
    other = sets.synthetic_splits(64, 16, seed=2)
    assert torch.equal(first.train.images, again.train.images)
    assert not torch.equal(first.train.images, other.train.images)


def test_batched_and_per_image_augmentation_give_the_same_pixels():
    images = torch.randint(0, 256, (9, 3, 12, 12), dtype=torch.uint8)
    image_set = sets.ImageSet(images, torch.arange(9))
    indices = [4, 0, 8, 2, 7]
    batches = device.DeviceResidentBatches(
        image_set, indices, 5, torch.device("cpu"), [0, 0, 0], [1, 1, 1], "crop-flip", 3, 2
    )
    batched, _ = next(iter(batches))
    for row, index in enumerate(indices):
        single = augment.crop_and_flip_one(images[index], index, seed=3, epoch=2).float() / 255
        assert torch.allclose(batched[row], single)
