"""The ImageNet recipe's augmentation (`--augment`): random-resized crop boxes drawn as
torchvision draws them but from (seed, epoch, index), the same box and nearly the same pixels
on the loader and device paths, and validation's resize-then-centre-crop on both."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import run_cli
from PIL import Image
from test_cli import help_lines, option_row
from test_speed_paths import assert_same_batches, collect, context, pipeline, tiny_config

from ddpcli.data import augment, device, layout, sets

# --- The boxes: torchvision's distribution, a pure function of (seed, epoch, index) -----------


def our_boxes(height: int, width: int, count: int, seed: int = 0, epoch: int = 0):
    return augment.resized_crop_boxes(
        seed, epoch, torch.arange(count), torch.full((count,), height), torch.full((count,), width)
    )


def torchvision_boxes(height: int, width: int, count: int) -> torch.Tensor:
    """(count, 4) top, left, height, width from RandomResizedCrop.get_params itself."""
    from torchvision.transforms import RandomResizedCrop

    torch.manual_seed(0)
    image = torch.empty(3, height, width)
    scale, ratio = list(augment.RRC_SCALE), list(augment.RRC_RATIO)
    return torch.tensor([RandomResizedCrop.get_params(image, scale, ratio) for _ in range(count)])


def ks_statistic(first: torch.Tensor, second: torch.Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov: the largest gap between the empirical CDFs."""
    points = torch.cat([first, second]).double().sort().values
    cdf = [torch.searchsorted(s.double().sort().values, points, right=True) / len(s)
           for s in (first, second)]  # fmt: skip
    return float((cdf[0] - cdf[1]).abs().max())


def shape_statistics(top, left, box_h, box_w, height, width) -> dict[str, torch.Tensor]:
    top, left, box_h, box_w = (values.double() for values in (top, left, box_h, box_w))
    return {
        "area": box_h * box_w / (height * width),
        "aspect": box_w / box_h,
        "centre_row": (top + box_h / 2) / height,
        "centre_col": (left + box_w / 2) / width,
    }


# (height, width): a 500x375 photograph lying and standing, and a strip where most tries fail
# and torchvision falls back to its centre crop.
@pytest.mark.parametrize("height,width", [(375, 500), (500, 375), (60, 900)])
def test_boxes_follow_torchvision_random_resized_crop(height, width):
    count = 10_000
    ours = our_boxes(height, width, count)
    theirs = torchvision_boxes(height, width, count)
    got = shape_statistics(ours.top, ours.left, ours.height, ours.width, height, width)
    want = shape_statistics(*theirs.unbind(1), height, width)
    # 1.95 * sqrt(2 / 10,000) = 0.028 is the KS critical value at p = 0.001.
    for name in got:
        assert ks_statistic(got[name], want[name]) < 0.028, name
    quantiles = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9], dtype=torch.float64)
    area_gap = got["area"].quantile(quantiles) - want["area"].quantile(quantiles)
    assert area_gap.abs().max() < 0.02
    assert 0.46 < ours.flip.double().mean() < 0.54
    inside = (ours.top >= 0) & (ours.left >= 0)
    inside &= (ours.top + ours.height <= height) & (ours.left + ours.width <= width)
    assert inside.all() and (ours.height > 0).all() and (ours.width > 0).all()


@pytest.mark.parametrize("height,width", [(2, 1000), (1000, 2), (4, 4)])
def test_after_ten_failed_tries_the_box_is_torchvision_centre_crop(height, width):
    # A 2 px strip fits no box of at least 8 % of its area and aspect 3/4-4/3: every try
    # fails, and torchvision's fallback is deterministic. A 4x4 image fits most tries.
    ours = our_boxes(height, width, 50)
    drawn = torch.stack([ours.top, ours.left, ours.height, ours.width], dim=1)
    if height == width:
        assert len(drawn.unique(dim=0)) > 5  # not the fallback every time
        return
    assert torch.equal(drawn, torchvision_boxes(height, width, 50))


def test_a_sample_always_gets_the_same_box():
    indices = torch.tensor([17, 3, 250_000, 3])
    heights, widths = torch.tensor([375, 480, 90, 480]), torch.tensor([500, 640, 1000, 640])
    batch = augment.resized_crop_boxes(5, 2, indices, heights, widths)
    again = augment.resized_crop_boxes(5, 2, indices, heights, widths)
    fields = ("top", "left", "height", "width", "flip")
    for field in fields:
        assert torch.equal(getattr(batch, field), getattr(again, field))
        assert getattr(batch, field)[1] == getattr(batch, field)[3]  # same sample, same box
    for row, index in enumerate(indices.tolist()):  # alone, as the loader draws it
        single = augment.resized_crop_boxes(
            5, 2, torch.tensor([index]), heights[row : row + 1], widths[row : row + 1]
        )
        assert all(getattr(single, f)[0] == getattr(batch, f)[row] for f in fields)
    for seed, epoch in ((5, 3), (6, 2)):  # another epoch or seed: other boxes
        other = augment.resized_crop_boxes(seed, epoch, indices, heights, widths)
        assert any(not torch.equal(getattr(other, f), getattr(batch, f)) for f in fields)


# --- Resampling: the loader's crop and the device path's batched grid_sample ------------------


def ramp_image(height: int, width: int, shade: int = 1) -> torch.Tensor:
    """uint8 (3, H, W) whose pixels say where they are: red grows left to right, green top to
    bottom. A box taken elsewhere, or mirrored, shows at once."""
    rows = torch.linspace(0, 1, height).view(height, 1).expand(height, width)
    cols = torch.linspace(0, 1, width).view(1, width).expand(height, width)
    image = torch.stack([cols, rows, (cols + rows) * shade / 4]) * 255
    return image.round().to(torch.uint8)


def test_batched_resample_of_a_whole_view_matches_the_crop_of_the_decoded_image():
    shapes = [(30, 40), (44, 30), (32, 32), (20, 60), (375, 500)]
    size, side = 16, layout.resize_side(16)
    indices = torch.arange(len(shapes))
    decoded = [ramp_image(h, w) for h, w in shapes]
    stored = torch.stack([sets.whole_view(image, size) for image in decoded])
    heights, widths = torch.tensor(shapes).unbind(1)
    boxes = augment.resized_crop_boxes(1, 4, indices, heights, widths)
    batched = augment.resample_boxes(stored, boxes, heights, widths, size)
    assert stored.shape[-1] == side and batched.shape == (len(shapes), 3, size, size)
    for row, image in enumerate(decoded):
        single = augment.resized_crop_one(image, row, 1, 4, size).float()
        assert (batched[row] - single).abs().mean() < 2.0  # of 255


def tiny_folder(root, shapes=((30, 40), (44, 30), (32, 32), (20, 60))):
    """Two classes of smooth, non-square ramps in the ImageNet layout."""
    for split in ("train", "val"):
        for label, name in enumerate(("a", "b")):
            folder = root / split / name
            folder.mkdir(parents=True)
            for number, (height, width) in enumerate(shapes):
                pixels = ramp_image(height, width, shade=label + 1).permute(1, 2, 0).numpy()
                Image.fromarray(pixels).save(folder / f"{number}.png")


def to_pixels(images: torch.Tensor, mean, std) -> torch.Tensor:
    """Normalised batches back on the 0-255 scale."""
    return (images * torch.tensor(std).view(1, 3, 1, 1) + torch.tensor(mean).view(1, 3, 1, 1)) * 255


def test_loader_and_device_paths_crop_the_same_boxes_of_an_image_folder(tmp_path):
    tiny_folder(tmp_path / "imgs")
    cfg = tiny_config(
        tmp_path / "out", dataset="imagefolder", data_dir=tmp_path / "imgs", per_gpu_batch=4
    )
    ctx = context()
    device_path, loader_path = pipeline(cfg, ctx, True), pipeline(cfg, ctx, False)
    assert device_path.augment == loader_path.augment == "rrc"  # auto, for image folders
    assert device_path.train_set.images.shape[-1] == layout.resize_side(16) == 18
    assert device_path.train_set.sizes.tolist()[:4] == [[30, 40], [44, 30], [32, 32], [20, 60]]
    mean, std = device_path.mean, device_path.std
    for epoch in (0, 1):
        device_batches = collect(device_path.train_batches(epoch))
        loader_batches = collect(loader_path.train_batches(epoch))
        assert len(device_batches) == len(loader_batches) == 2
        for (images, labels), (want_images, want_labels) in zip(
            device_batches, loader_batches, strict=True
        ):
            assert torch.equal(labels, want_labels) and images.shape == (4, 3, 16, 16)
            gap = (to_pixels(images, mean, std) - to_pixels(want_images, mean, std)).abs()
            assert gap.mean() < 1.5 and gap.max() < 12  # of 255: interpolation alone
    first, second = (collect(device_path.train_batches(e))[0][0] for e in (0, 1))
    assert not torch.allclose(first, second)  # each epoch draws new boxes
    # Resumed in a new process after the first batch of epoch 1: the rest, bit for bit.
    for data_path, device_resident in ((device_path, True), (loader_path, False)):
        resumed = collect(pipeline(cfg, ctx, device_resident).train_batches(1, skip_batches=1))
        assert_same_batches(resumed, collect(data_path.train_batches(1))[1:])
    # Validation is the same code on both paths: bit for bit.
    for (images, labels), (want_images, want_labels) in zip(
        collect(device_path.val_batches()), collect(loader_path.val_batches()), strict=True
    ):
        assert torch.equal(images, want_images) and torch.equal(labels, want_labels)


def test_validation_resizes_the_shorter_side_then_crops_the_centre():
    from torchvision.transforms import v2

    image = ramp_image(375, 500)
    reference = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224)])
    assert torch.equal(sets.centre_view(image, 224), reference(image))
    assert layout.resize_side(224) == 256


# --- --augment: auto, none, crop-flip -------------------------------------------------------


def test_auto_is_rrc_for_image_folders_and_crop_flip_for_in_memory_sets():
    assert layout.training_augment("auto", "imagefolder") == "rrc"
    assert layout.training_augment("auto", "synthetic") == "crop-flip"
    assert layout.training_augment("auto", "stl10") == "crop-flip"
    assert layout.training_augment("none", "imagefolder") == "none"


@pytest.mark.parametrize("choice", ["none", "crop-flip"])
def test_image_folder_without_rrc_keeps_the_paths_bit_identical(tmp_path, choice):
    tiny_folder(tmp_path / "imgs")
    cfg = tiny_config(
        tmp_path / "out", dataset="imagefolder", data_dir=tmp_path / "imgs", per_gpu_batch=4,
        augment=choice,
    )  # fmt: skip
    ctx = context()
    device_path, loader_path = pipeline(cfg, ctx, True), pipeline(cfg, ctx, False)
    # Training starts from validation's view, held at the training size.
    samples = layout.folder_samples(tmp_path / "imgs" / "train", ["a", "b"])
    views = torch.stack([sets.centre_view(sets.read_rgb(path), 16) for path, _ in samples])
    assert torch.equal(device_path.train_set.images, views)
    assert device_path.train_set.sizes is None
    for epoch in (0, 1):
        for (images, labels), (want_images, want_labels) in zip(
            collect(device_path.train_batches(epoch)),
            collect(loader_path.train_batches(epoch)),
            strict=True,
        ):
            assert torch.equal(images, want_images) and torch.equal(labels, want_labels)


def test_rrc_on_an_in_memory_set_gives_the_same_pixels_batched_and_alone():
    images = torch.stack([ramp_image(24, 24, shade) for shade in range(6)])
    image_set = sets.ImageSet(images, torch.arange(6))
    indices = [4, 0, 5, 2]
    batches = device.DeviceResidentBatches(
        image_set, indices, 4, torch.device("cpu"), [0, 0, 0], [1, 1, 1], "rrc", seed=3, epoch=1
    )
    batched, _ = next(iter(batches))
    for row, index in enumerate(indices):
        single = augment.resized_crop_one(images[index], index, 3, 1, 24).float()
        assert (batched[row] * 255 - single).abs().mean() < 1.5


def test_augment_flag_shows_its_choices_and_rejects_others(tmp_path):
    row = option_row(help_lines("train"), "--augment")
    assert "[auto|rrc|crop-flip|none]" in row and "[default: auto]" in row
    bad = run_cli("train", "--augment", "mixup", "--dry-run", "--out", str(tmp_path))
    assert bad.returncode == 2 and "--augment" in bad.stderr and "Traceback" not in bad.stderr
    resolved = run_cli("train", "--dry-run", "--json", "--out", str(tmp_path))
    assert json.loads(resolved.stdout)["augment"] == "crop-flip"  # what ran, in config.json


def test_one_image_box_in_python_matches_the_batched_draw():
    # The loader draws one box per image in Python floats; the device path draws batches in
    # float64 tensors: the same box, fallbacks (extreme aspects, tiny images) included.
    rng = random.Random(0)
    sides = [1, 3, 5, 37, 375, 500, 1000, 2000]
    cases = [
        (rng.randrange(10**6), rng.randrange(99), rng.randrange(300), rng.choice(sides),
         rng.choice(sides))
        for _ in range(400)
    ]  # fmt: skip
    indices = torch.tensor([case[0] for case in cases])
    for seed, epoch in {(case[1], case[2]) for case in cases[:40]}:
        heights = torch.tensor([case[3] for case in cases])
        widths = torch.tensor([case[4] for case in cases])
        boxes = augment.resized_crop_boxes(seed, epoch, indices, heights, widths)
        for row, (index, _, _, height, width) in enumerate(cases):
            want = (boxes.top[row], boxes.left[row], boxes.height[row], boxes.width[row])
            got = augment.crop_box_one(index, seed, epoch, height, width)
            assert got[:4] == tuple(int(v) for v in want) and got.flip == bool(boxes.flip[row])
