"""`--decode gpu`: the workers read bytes, the rank decodes and views each batch on its device
(ddpcli.data.encoded). On the CPU the same code runs with libjpeg-turbo in place of nvjpeg,
so these tests hold it to the CPU path: the same boxes and flips for a seed, pixels within
the bounds the module states, the images nvjpeg does not take counted; and the runs and
refusals a user sees. The nvjpeg tests at the end need a GPU."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from PIL import Image

from ddpcli.data.decode import UnreadableImage
from ddpcli.data.encoded import (
    DecodeOnDevice,
    EncodedBatch,
    EncodedFiles,
    EncodedMembers,
    collate_encoded,
    encoded_item,
)
from ddpcli.data.loader import FolderDataset

SEED, EPOCH = 3, 1


def photo(height: int, width: int, seed: int) -> Image.Image:
    """A smooth picture with some texture: what JPEG is made for (noise alone would make
    every decoder's rounding show)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.linspace(0, 1, height).view(height, 1, 1)
    cols = torch.linspace(0, 1, width).view(1, width, 1)
    tint = torch.rand(1, 1, 3, generator=generator)
    pixels = 255 * (0.5 * rows * tint + 0.3 * cols * (1 - tint))
    pixels = pixels + 40 * torch.rand(height, width, 3, generator=generator)
    return Image.fromarray(pixels.clamp(0, 255).to(torch.uint8).numpy())


def write_photos(folder: Path, sizes: list[tuple[int, int]]) -> list[tuple[Path, int]]:
    folder.mkdir(parents=True, exist_ok=True)
    samples = []
    for index, (height, width) in enumerate(sizes):
        path = folder / f"{index}.jpg"
        photo(height, width, index).save(path, quality=92)
        samples.append((path, index % 2))
    return samples


def on_device_batch(
    samples, keys: list[int], augment: str, size: int, view=None, auto_augment=None
) -> tuple[torch.Tensor, DecodeOnDevice]:
    """The encoded path's batch for KEYS, in levels 0..255 (mean 0, std 1/255)."""
    files = EncodedFiles(samples, SEED, augment)  # type: ignore[arg-type]
    batch, labels = collate_encoded([files[(key, EPOCH)] for key in keys])
    stage = DecodeOnDevice(
        torch.device("cpu"), [0.0] * 3, [1 / 255] * 3, False, augment, size, SEED,  # type: ignore[arg-type]
        view=view, auto_augment=auto_augment,
    )  # fmt: skip
    images, out_labels = stage(batch, labels)
    assert out_labels.tolist() == [samples[key % len(samples)][1] for key in keys]
    return images.round(), stage  # the normalisation's float residue (x / 255 * 255)


def cpu_path_batch(samples, keys: list[int], augment: str, size: int, **recipe) -> torch.Tensor:
    dataset = FolderDataset(samples, size, SEED, augment, **recipe)  # type: ignore[arg-type]
    return torch.stack([dataset[(key, EPOCH)][0] for key in keys]).float()


def test_random_resized_crops_match_the_cpu_path_within_one_level(tmp_path):
    """Small photos: the CPU path decodes them at full scale, so the same boxes give the
    same pixels but for the last rounding (its uint8 resize, this float one)."""
    samples = write_photos(tmp_path, [(40, 56), (48, 36), (33, 60), (64, 40)])
    keys = list(range(12))  # three draws of each image
    ours, stage = on_device_batch(samples, keys, "rrc", 32)
    theirs = cpu_path_batch(samples, keys, "rrc", 32)
    assert ours.shape == theirs.shape == (12, 3, 32, 32)
    assert (ours - theirs).abs().max() <= 1
    assert stage.decoded_on_cpu == 0  # every one a colour JPEG


def test_large_photos_stay_within_interpolation_tolerance(tmp_path):
    """ImageNet-sized photos cropped to 32 px: the CPU path decodes most of them at a
    reduced scale (libjpeg's DCT scaling); this path decodes whole and resizes. Measured
    here: the mean difference under 2 levels."""
    samples = write_photos(tmp_path, [(350, 400), (300, 420), (375, 500)])
    keys = list(range(9))
    ours, _ = on_device_batch(samples, keys, "rrc", 32)
    theirs = cpu_path_batch(samples, keys, "rrc", 32)
    difference = (ours - theirs).abs()
    assert difference.mean() < 2, difference.mean()
    assert difference.max() < 64  # a mirrored or other box would differ everywhere


def test_validations_centred_view_matches_the_cpu_path(tmp_path):
    samples = write_photos(tmp_path, [(40, 56), (56, 40), (45, 45)])
    keys = [0, 1, 2]
    ours, _ = on_device_batch(samples, keys, "none", 32, view=(36, 32))
    theirs = cpu_path_batch(samples, keys, "none", 32, view=(36, 32))
    assert ours.shape == (3, 3, 32, 32)
    assert (ours - theirs).abs().max() <= 1


def test_crop_and_flip_and_auto_augment_match_the_cpu_path(tmp_path):
    from ddpcli.data.autoaugment import policy_transform

    samples = write_photos(tmp_path, [(40, 56), (48, 36)])
    keys = [0, 1, 2, 3]
    ours, _ = on_device_batch(samples, keys, "crop-flip", 24)
    theirs = cpu_path_batch(samples, keys, "crop-flip", 24)
    assert (ours - theirs).abs().max() <= 1
    policy = policy_transform("ta_wide")
    ours, _ = on_device_batch(samples, keys, "rrc", 24, auto_augment=policy)
    theirs = cpu_path_batch(samples, keys, "rrc", 24, auto_augment=policy)
    # The same operation drawn per image; a level's rounding may move a colour op's result.
    assert (ours - theirs).abs().float().mean() < 1


def test_images_nvjpeg_does_not_take_travel_as_pixels_and_are_counted(tmp_path):
    samples = write_photos(tmp_path, [(40, 56)])
    extra = [("p.png", "RGB"), ("cmyk.jpg", "CMYK"), ("grey.jpg", "L"), ("prog.jpg", "RGB")]
    for name, mode in extra:
        image = photo(44, 52, 9).convert(mode)
        image.save(tmp_path / name, **({"progressive": True} if name == "prog.jpg" else {}))
        samples.append((tmp_path / name, 0))
    keys = [0, 1, 2, 3, 4]
    ours, stage = on_device_batch(samples, keys, "rrc", 32)
    theirs = cpu_path_batch(samples, keys, "rrc", 32)
    assert (ours[0] - theirs[0]).abs().max() <= 1
    # Where the CPU path resizes with PIL's resampler (not the progressive JPEG, which it
    # decodes straight), this path with torch's: the same filter, computed apart (measured:
    # mean 0.3, at most 6 levels).
    difference = (ours[1:] - theirs[1:]).abs()
    assert difference.mean() < 1 and difference.max() <= 8, (difference.mean(), difference.max())
    assert (ours[4] - theirs[4]).abs().max() <= 1
    assert stage.decoded_on_cpu == 4  # the PNG, the CMYK, grey and progressive JPEGs
    batch, _ = collate_encoded([EncodedFiles(samples, SEED, "rrc")[(key, 0)] for key in keys])  # type: ignore[arg-type]
    assert batch.raw.tolist() == [False, True, True, True, True]


def test_an_unreadable_file_is_named(tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8 not a jpeg at all")
    with pytest.raises(UnreadableImage, match="bad.jpg"):
        EncodedFiles([(bad, 0)], SEED, "rrc")[(0, 0)]  # type: ignore[list-item]
    # A header that reads, a body cut short: the rank's decoder names it.
    good = io.BytesIO()
    photo(40, 40, 1).save(good, "JPEG")
    cut = tmp_path / "cut.jpg"
    cut.write_bytes(good.getvalue()[:200])
    files = EncodedFiles([(cut, 0)], SEED, "none")  # type: ignore[list-item]
    batch, labels = collate_encoded([files[(0, 0)]])
    stage = DecodeOnDevice(torch.device("cpu"), [0.0] * 3, [1.0] * 3, False, "none", 16, SEED)
    with pytest.raises(UnreadableImage, match="cut.jpg"):
        stage(batch, labels)


def test_a_batch_split_and_joined_keeps_every_item(tmp_path):
    """Shards' chunks are cut between batches and joined again (RankBatches)."""
    samples = write_photos(tmp_path, [(40, 56), (48, 36), (33, 60), (64, 40)])
    members = EncodedMembers(SEED, "rrc")

    class Sample:  # a RawSample's fields
        def __init__(self, number: int, path: Path) -> None:
            self.number, self.name, self.image = number, f"s:{number}", path.read_bytes()

    items = [members.image(Sample(number, path), EPOCH) for number, (path, _) in enumerate(samples)]
    whole = EncodedBatch.of(items, [0, 1, 2, 3], EPOCH)
    rejoined = EncodedBatch.cat([whole[:1], whole[1:3], whole[3:]])
    for field in ("data", "ends", "sizes", "boxes", "raw", "keys"):
        assert torch.equal(getattr(rejoined, field), getattr(whole, field)), field
    assert rejoined.names == whole.names == ["s:0", "s:1", "s:2", "s:3"]
    assert [bytes(item.numpy()) for item in whole[1:3].items()] == [
        path.read_bytes() for path, _ in samples[1:3]
    ]


def test_encoded_items_draw_the_cpu_paths_boxes(tmp_path):
    from ddpcli.data.augment import crop_box_one

    (path, _), *_ = write_photos(tmp_path, [(70, 90)])
    for key in range(5):
        item = encoded_item(path, lambda h, w, key=key: crop_box_one(key, SEED, EPOCH, h, w))
        assert (item.height, item.width) == (70, 90)
        assert item.box == tuple(int(v) for v in crop_box_one(key, SEED, EPOCH, 70, 90))


# --- what a user runs -------------------------------------------------------------------


def write_folder(root: Path) -> Path:
    for split, count in (("train", 10), ("val", 4)):
        for label in ("a", "b"):
            write_photos(root / split / label, [(40 + i, 50 - i) for i in range(count)])
    photo(40, 40, 7).save(root / "train" / "a" / "extra.png")
    photo(40, 40, 8).convert("CMYK").save(root / "train" / "b" / "extra.jpg")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("decode") / "folder")


TINY = (
    "--cpu", "--nproc", "2", "--arch", "tinycnn", "--image-size", "16", "--per-gpu-batch",
    "4", "--workers", "1", "--seed", "1",
)  # fmt: skip


@pytest.mark.parametrize("dataset", ["imagefolder", "shards"])
def test_a_run_decodes_on_the_rank_and_counts_what_it_could_not(tmp_path, folder, dataset):
    data = folder
    if dataset == "shards":
        data = tmp_path / "shards"
        packed = run_cli("data", "pack", str(folder), str(data), "--shard-size", "30K")
        assert packed.returncode == 0, packed.stderr
    out = tmp_path / "run"
    # --timeout 60: a stuck rank is named by the job, before the test's own limit ends it.
    result = run_cli(
        "train", *TINY, "--dataset", dataset, "--data-dir", str(data), "--decode", "gpu",
        "--epochs", "2", "--out", str(out), "--timeout", "60", timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "decode gpu: the loader workers read the bytes; libjpeg-turbo on cpu"
        in result.stdout + result.stderr
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["val_samples"] == 8 for row in rows)
    # The PNG and the CMYK JPEG, each epoch: shards train every sample; the folder path
    # drops a partial batch (22 images, 20 trained), so it may leave one of them out.
    counts = [row["decoded_on_cpu"] for row in rows]
    assert counts == [2, 2] if dataset == "shards" else all(1 <= c <= 2 for c in counts), counts
    lines = (result.stdout + result.stderr).splitlines()
    for row in rows:  # each epoch's line says its count
        count = row["decoded_on_cpu"]
        (line,) = [line for line in lines if line.startswith(f"epoch {row['epoch']}/2 · train")]
        assert line.endswith(f"{count} image{'s' if count != 1 else ''} decoded on the CPU instead")
    config = json.loads((out / "config.json").read_text())
    assert config["decode"] == "gpu"


def test_auto_decodes_in_the_workers_on_the_cpu(tmp_path, folder):
    out = tmp_path / "run"
    result = run_cli(
        "train", *TINY, "--dataset", "imagefolder", "--data-dir", str(folder), "--max-steps",
        "1", "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "decode cpu (auto: a CPU run, whose loader workers decode in parallel)"
        in result.stdout + result.stderr
    )
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert "decoded_on_cpu" not in row


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--dataset", "synthetic"), "--dataset synthetic holds none to decode"),
        (
            ("--dataset", "imagefolder", "--data-path", "device"),
            "--data-path device decodes the image folder once",
        ),
    ],
)
def test_decode_gpu_where_there_is_nothing_to_decode_is_refused(in_process, folder, flags, says):
    result = in_process(
        "train", "--cpu", "--decode", "gpu", "--data-dir", str(folder), *flags, "--dry-run"
    )
    assert result.returncode == 2
    assert "invalid --decode" in result.stderr and says in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 2


def test_auto_is_settled_from_the_run_and_the_decoder_there(monkeypatch):
    from ddpcli.config import TrainConfig
    from ddpcli.launcher import resolve

    def request(**settings) -> TrainConfig:
        return TrainConfig(data_dir=Path("/data"), **settings)

    assert resolve.planned_decode(request(dataset="imagefolder"), on_gpu=True)[0] == "gpu"
    assert resolve.planned_decode(request(dataset="shards"), on_gpu=True)[0] == "gpu"
    assert resolve.planned_decode(request(dataset="imagefolder"), on_gpu=False)[0] == "cpu"
    folder_once = request(dataset="imagefolder", data_path="device")
    assert resolve.planned_decode(folder_once, on_gpu=True) == (
        "cpu", "auto: training reads no JPEG files",
    )  # fmt: skip
    assert resolve.planned_decode(request(dataset="imagefolder", decode="cpu"), True) == (
        "cpu", None,
    )  # fmt: skip

    class Plan:  # the fields checked_decoder reads
        def __init__(self, reason: str | None) -> None:
            self.decode, self.decode_reason, self.cpu = "gpu", reason, False

    monkeypatch.setattr("ddpcli.data.encoded.device_decoder_missing", lambda _: "no nvjpeg op")
    assert resolve.checked_decoder(Plan("auto: a GPU run reading JPEGs")) == (  # type: ignore[arg-type]
        "cpu", "auto: no nvjpeg op",
    )  # fmt: skip
    from ddpcli.errors import DdpcliError

    with pytest.raises(DdpcliError, match="invalid --decode: gpu needs the rank's JPEG decoder"):
        resolve.checked_decoder(Plan(None))  # type: ignore[arg-type]


# --- on a GPU: nvjpeg itself ------------------------------------------------------------


@pytest.mark.gpu
def test_nvjpeg_batches_match_the_cpu_decoder(tmp_path):
    """nvjpeg's IDCT and colour conversion are not libjpeg-turbo's: within a few levels."""
    samples = write_photos(tmp_path, [(350, 400), (300, 420), (64, 80), (375, 500)])
    keys = list(range(8))
    files = EncodedFiles(samples, SEED, "rrc")  # type: ignore[arg-type]
    batch, labels = collate_encoded([files[(key, EPOCH)] for key in keys])
    results = []
    for device in ("cuda", "cpu"):
        stage = DecodeOnDevice(
            torch.device(device),
            [0.0] * 3,
            [1 / 255] * 3,
            True,
            "rrc",
            64,
            SEED,  # type: ignore[arg-type]
        )
        images, _ = stage(batch, labels)
        assert stage.decoded_on_cpu == 0
        results.append(images.float().cpu())
    difference = (results[0] - results[1]).abs()
    assert difference.mean() < 1.5 and difference.max() <= 16, (difference.mean(), difference.max())


@pytest.mark.gpu
def test_a_gpu_run_decodes_with_nvjpeg(tmp_path, folder):
    out = tmp_path / "run"
    result = run_cli(
        "train", "--gpus", "0", "--arch", "tinycnn", "--image-size", "16", "--per-gpu-batch",
        "4", "--dataset", "imagefolder", "--data-dir", str(folder), "--max-steps", "4",
        "--out", str(out), timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "decode gpu (auto: a GPU run reading JPEGs)" in result.stdout + result.stderr
    assert "nvjpeg on cuda:0" in result.stdout + result.stderr
