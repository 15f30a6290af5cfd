"""benchmarks/imagenet_sized.py: ImageNet-sized JPEGs, as a folder and as shards, for the GPU
check's resnet50 rows. Run for real at a tiny size: the files, their size, the shards."""

import json
import subprocess
import sys

from conftest import REPO, benchmark_module, clean_env
from PIL import Image

SCRIPT = REPO / "benchmarks" / "imagenet_sized.py"


def make(out, *flags):
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *flags],
        capture_output=True, text=True, env=clean_env(), cwd=out.parent, timeout=120,
    )  # fmt: skip


def test_it_writes_photograph_sized_jpegs_and_packs_them(tmp_path):
    done = make(tmp_path / "data", "--images", "16", "--classes", "2")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    folder = tmp_path / "data" / "folder"
    train, val = sorted((folder / "train").rglob("*.jpg")), sorted((folder / "val").rglob("*.jpg"))
    assert (len(train), len(val)) == (16, 4)  # 2 validation images per class
    assert {path.parent.name for path in train} == {"class000", "class001"}
    for path in train + val:
        assert 40_000 < path.stat().st_size < 130_000, path  # a photograph's, not a flat colour's
        with Image.open(path) as image:
            assert (image.format, image.size, image.mode) == ("JPEG", (400, 350), "RGB")
    assert 40 < report["kB"]["min"] <= report["kB"]["mean"] <= report["kB"]["max"] < 130
    index = json.loads((tmp_path / "data" / "shards" / "index.json").read_text())
    assert index["splits"]["train"]["samples"] == 16
    assert index["splits"]["val"]["samples"] == 4
    assert (tmp_path / "data" / "shards" / "train-000000.tar").exists()


def test_the_same_seed_makes_the_same_pixels():
    with benchmark_module("imagenet_sized") as module:
        assert (module.photo(5) == module.photo(5)).all()
        assert (module.photo(5) != module.photo(6)).any()
        assert module.photo(5).shape == (350, 400, 3)


def test_a_folder_already_written_is_refused(tmp_path):
    (tmp_path / "data" / "folder").mkdir(parents=True)
    (tmp_path / "data" / "folder" / "kept.txt").write_text("someone's")
    done = make(tmp_path / "data", "--images", "2", "--classes", "2")
    assert done.returncode == 2
    assert "exists and is not empty" in done.stderr
    assert (tmp_path / "data" / "folder" / "kept.txt").read_text() == "someone's"
