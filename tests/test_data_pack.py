"""`ddpcli data pack|verify`: an image folder or STL-10 into WebDataset-format tar shards
with an index, byte for byte the same every time, read by webdataset, checked by verify."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import sys
import tarfile
import time
from pathlib import Path, PurePath
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import LiveProcess, clean_env, run_cli
from PIL import Image
from test_cli import run_importing

from ddpcli.config.data import parse_size
from ddpcli.data.shards.pack import PENDING_NAME
from ddpcli.data.shards.sources import sample_key

CLASSES = ["bird", "cat", "dog"]


def write_image_folder(root: Path, train_per_class: int = 8, val_per_class: int = 3) -> Path:
    """Small PNGs and JPEGs of a few sizes, a hidden folder that is no class, a file name with
    dots (a webdataset key must have none in its base name)."""
    rng = np.random.default_rng(0)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for label, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True)
            for number in range(count):
                side = 16 + 4 * number
                pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
                pixels[..., label] = 255
                kind = "png" if number % 2 else "jpg"
                stem = f"img.{number:03d}" if number == 1 else f"img{number:03d}"
                Image.fromarray(pixels).save(folder / f"{stem}.{kind}")
    hidden = root / "train" / ".ipynb_checkpoints"
    hidden.mkdir()
    Image.new("RGB", (8, 8)).save(hidden / "stray.png")
    return root


def source_files(root: Path, split: str) -> dict[str, tuple[bytes, int]]:
    """Every image of SPLIT by its key: its bytes and its class index."""
    found = {}
    for label, name in enumerate(CLASSES):
        for path in (root / split / name).iterdir():
            found[sample_key(path.relative_to(root))] = (path.read_bytes(), label)
    return found


def shard_members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {member.name: tar.extractfile(member).read() for member in tar}  # type: ignore[union-attr]


def pack(src: Path, out: Path, *flags: str, json_output: bool = True):
    """`ddpcli data pack` as a user runs it, in a process of its own."""
    args = ["data", "pack", str(src), str(out), *flags] + (["--json"] if json_output else [])
    return run_cli(*args, timeout=120)


def invoke(*args: str):
    """`ddpcli ARGS` in this process (no interpreter to start): exit code, stdout, stderr."""
    from typer.testing import CliRunner

    from ddpcli.cli import app

    result = CliRunner().invoke(app, list(args))
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr)


def all_files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """One image folder packed in small shards by two processes (module-wide: packing is
    the slow part)."""
    root = tmp_path_factory.mktemp("packed")
    src = write_image_folder(root / "src")
    out = root / "shards"
    result = pack(src, out, "--shard-size", "8K", "--workers", "2")
    assert result.returncode == 0, result.stderr
    return src, out, json.loads(result.stdout)


@pytest.mark.parametrize("args", [["data", "--help"], ["data", "pack", "--help"]])
def test_data_help_answers_without_importing_torch(args):
    result, imported = run_importing(*args)
    assert "torch" not in imported and "Usage" in result.stdout


def test_pack_writes_shards_and_an_index_that_describes_them(packed):
    src, out, report = packed
    index = json.loads((out / "index.json").read_text())
    assert index["format"] == "ddpcli-shards/1" and index["source"] == "imagefolder"
    assert set(index["splits"]) == {"train", "val"}
    for split, count in (("train", 24), ("val", 9)):
        entry = index["splits"][split]
        assert entry["classes"] == CLASSES  # the hidden folder is no class
        assert entry["samples"] == count == report["splits"][split]["samples"]
        names = [shard["name"] for shard in entry["shards"]]
        assert names == [f"{split}-{number:06d}.tar" for number in range(len(names))]
        assert sum(shard["samples"] for shard in entry["shards"]) == count
        for shard in entry["shards"]:
            data = (out / shard["name"]).read_bytes()
            assert len(data) == shard["bytes"]
            import hashlib

            assert hashlib.sha256(data).hexdigest() == shard["sha256"]
    assert len(index["splits"]["train"]["shards"]) >= 3  # 8K shards: several
    # Nothing but the shards and the index: no temporary file left behind.
    assert sorted(path.name for path in out.iterdir()) == sorted(
        ["index.json"] + [s["name"] for e in index["splits"].values() for s in e["shards"]]
    )


def test_every_member_is_the_source_file_unchanged_with_its_class(packed):
    src, out, _ = packed
    for split in ("train", "val"):
        expected = source_files(src, split)
        seen = {}
        for shard in sorted(out.glob(f"{split}-*.tar")):
            for name, data in shard_members(shard).items():
                key, _, suffix = name.partition(".")
                assert "." not in PurePath(key).name
                seen.setdefault(key, {})[suffix] = data
        assert set(seen) == set(expected)
        for key, members in seen.items():
            image, label = expected[key]
            (suffix,) = set(members) - {"cls"}
            assert suffix in ("jpg", "png") and members[suffix] == image
            assert members["cls"] == str(label).encode()
        # Samples are spread over shards in a seeded order: each shard mixes classes.
        first = shard_members(sorted(out.glob(f"{split}-*.tar"))[0])
        assert len({data for name, data in first.items() if name.endswith(".cls")}) >= 2


def test_tar_headers_carry_nothing_of_the_machine(packed):
    _, out, _ = packed
    with tarfile.open(out / "train-000000.tar") as tar:
        for member in tar:
            assert (member.mtime, member.uid, member.gid, member.mode) == (0, 0, 0, 0o644)
            assert member.uname == member.gname == ""


def test_packing_again_gives_the_same_bytes(packed, tmp_path):
    src, out, _ = packed
    again = tmp_path / "again"
    result = pack(src, again, "--shard-size", "8K", "--workers", "1", json_output=False)
    assert result.returncode == 0, result.stderr
    assert "train: 24 samples of 3 classes" in result.stderr
    assert all_files(again) == all_files(out)


def test_webdataset_reads_the_shards_unchanged(packed):
    webdataset = pytest.importorskip("webdataset")
    src, out, _ = packed
    for split in ("train", "val"):
        expected = source_files(src, split)
        urls = [str(path) for path in sorted(out.glob(f"{split}-*.tar"))]
        samples = list(webdataset.WebDataset(urls, shardshuffle=False).decode())
        assert len(samples) == len(expected)
        for sample in samples:
            image, label = expected[sample["__key__"]]
            assert sample["cls"] == label
            assert sample.get("jpg", sample.get("png")) == image


def test_verify_passes_then_names_each_bad_shard(packed, tmp_path):
    _, out, _ = packed
    result = invoke("data", "verify", str(out), "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert "train" in result.stderr and "ok" in result.stderr

    copy = tmp_path / "copy"
    copy.mkdir()
    for name, data in all_files(out).items():
        (copy / name).write_bytes(data)
    flipped, truncated, deleted = "train-000000.tar", "train-000001.tar", "val-000000.tar"
    data = bytearray((copy / flipped).read_bytes())
    data[700] ^= 0xFF
    (copy / flipped).write_bytes(bytes(data))
    (copy / truncated).write_bytes((copy / truncated).read_bytes()[:-1000])
    (copy / deleted).unlink()

    result = invoke("data", "verify", str(copy), "--json", "--workers", "1")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert sorted(report["bad"]) == sorted([flipped, truncated, deleted])
    statuses = {check["name"]: check["status"] for check in report["shards"]}
    assert statuses[flipped] == "changed" and statuses[truncated] == "truncated"
    assert statuses[deleted] == "missing"
    assert all(name in result.stderr for name in (flipped, truncated, deleted))
    good = set(statuses) - {flipped, truncated, deleted}
    assert good and not any(name in result.stderr for name in good)
    assert "Traceback" not in result.stderr


def test_force_replaces_an_earlier_pack_and_removes_its_extra_shards(packed, tmp_path):
    src, out, _ = packed
    target = tmp_path / "target"
    target.mkdir()
    for name, data in all_files(out).items():
        (target / name).write_bytes(data)
    (target / ".train-000000.tar.4242.partial").write_bytes(b"half a shard")  # a pack that died

    refused = invoke("data", "pack", str(src), str(target), "--shard-size", "1M", "--workers", "1")
    assert refused.returncode == 2 and "--force" in refused.stderr

    result = invoke(
        "data", "pack", str(src), str(target), "--shard-size", "1M", "--force", "--workers", "1"
    )
    assert result.returncode == 0, result.stderr
    assert sorted(path.name for path in target.iterdir()) == [
        "index.json", "train-000000.tar", "val-000000.tar",
    ]  # fmt: skip
    assert invoke("data", "verify", str(target), "--workers", "1").returncode == 0


def test_pack_never_touches_shard_named_files_no_pack_wrote(packed, tmp_path):
    """webdataset's tools name their shards train-000000.tar too: a pack that replaced or
    deleted them would destroy another tool's data. Only the shards an earlier pack's index
    names are replaced (--force) or deleted; anything else so named is refused (exit 2)."""
    src, out, _ = packed
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    files = {"notes.txt": b"x\n", "train-000999.tar": b"t\n", "val-000050.tar": b"v\n"}
    for name, data in files.items():
        (foreign / name).write_bytes(data)
    for force in ([], ["--force"]):
        args = ["data", "pack", str(src), str(foreign), "--shard-size", "8K", "--workers", "1"]
        stderr = one_line_error(invoke(*args, *force))
        assert "train-000999.tar, val-000050.tar" in stderr and "move them out" in stderr
        assert all_files(foreign) == files

    # Over a real pack with --force: a shard-named file its index never listed is kept.
    target = tmp_path / "target"
    target.mkdir()
    for name, data in all_files(out).items():
        (target / name).write_bytes(data)
    (target / "train-000999.tar").write_bytes(b"t\n")
    args = ["data", "pack", str(src), str(target), "--shard-size", "1M", "--workers", "1"]
    assert "train-000999.tar" in one_line_error(invoke(*args, "--force"))
    assert all_files(target) == {**all_files(out), "train-000999.tar": b"t\n"}


def write_stl10(root: Path, counts=(("train", 12), ("test", 5))) -> dict[str, tuple]:
    """A tiny set in the official layout: channel-major, each channel column-major."""
    rng = np.random.default_rng(1)
    folder = root / "stl10_binary"
    folder.mkdir(parents=True)
    written = {}
    for split, count in counts:
        labels = rng.integers(0, 10, count)
        pixels = rng.integers(0, 256, (count, 3, 96, 96), dtype=np.uint8)  # (n, c, row, col)
        pixels.transpose(0, 1, 3, 2).tofile(folder / f"{split}_X.bin")
        (labels + 1).astype(np.uint8).tofile(folder / f"{split}_y.bin")
        written[split] = (pixels, labels)
    (folder / "class_names.txt").write_text("\n".join(f"c{i}" for i in range(10)))
    return written


def test_stl10_packs_each_image_as_a_lossless_png(tmp_path):
    written = write_stl10(tmp_path / "stl")
    out = tmp_path / "shards"
    result = invoke(
        "data", "pack", str(tmp_path / "stl"), str(out), "--shard-size", "100K", "--workers", "1"
    )
    assert result.returncode == 0, result.stderr
    index = json.loads((out / "index.json").read_text())
    assert index["source"] == "stl10"
    assert index["splits"]["train"]["classes"] == [f"c{i}" for i in range(10)]
    for split, source_split in (("train", "train"), ("val", "test")):
        pixels, labels = written[source_split]
        assert index["splits"][split]["samples"] == len(labels)
        assert len(index["splits"][split]["shards"]) >= 2  # 100K: 3 images a shard
        members = {}
        for shard in sorted(out.glob(f"{split}-*.tar")):
            members.update(shard_members(shard))
        for number, label in enumerate(labels):
            key = f"{split}/{number:06d}"
            image = np.asarray(Image.open(io.BytesIO(members[f"{key}.png"])))
            assert np.array_equal(image, pixels[number].transpose(1, 2, 0))  # (row, col, c)
            assert members[f"{key}.cls"] == str(label).encode()
    assert invoke("data", "verify", str(out), "--workers", "1").returncode == 0


def one_line_error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) <= 2 and "Traceback" not in result.stderr, result.stderr
    return result.stderr


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    images = write_image_folder(tmp_path / "src", train_per_class=1, val_per_class=1)
    plain = tmp_path / "plain"
    plain.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    cases = [
        ((tmp_path / "missing", tmp_path / "o1"), "does not exist"),
        ((plain, tmp_path / "o2"), "neither an image folder"),
        ((images, a_file / "out"), "is a file"),
        # An index among the images would make `train --data-dir SRC` read shards.
        ((images, images), "is SRC"),
        ((images, images / "train" / "shards"), "inside SRC"),
    ]
    for (src, out), words in cases:
        assert words in one_line_error(invoke("data", "pack", str(src), str(out)))
    assert sorted(path.name for path in images.iterdir()) == ["train", "val"]
    assert not (images / "train" / "shards").exists()
    for size in ("12XB", "1M,2M", "0"):
        stderr = one_line_error(
            invoke("data", "pack", str(images), str(tmp_path / "o3"), "--shard-size", size)
        )
        assert "--shard-size" in stderr
    assert "index.json" in one_line_error(invoke("data", "verify", str(plain)))
    (plain / "index.json").write_text("{not json")
    assert "not a ddpcli shard index" in one_line_error(invoke("data", "verify", str(plain)))


def test_a_file_of_src_that_cannot_be_read_is_named_with_exit_2(tmp_path):
    """A symbolic link to nothing (as `ddpcli train` names an image it cannot read)."""
    images = write_image_folder(tmp_path / "src", train_per_class=1, val_per_class=1)
    link = images / "train" / "cat" / "gone.png"
    link.symlink_to(tmp_path / "nowhere.png")
    stderr = one_line_error(invoke("data", "pack", str(images), str(tmp_path / "out")))
    assert f"cannot read {link}: a symbolic link to {tmp_path / 'nowhere.png'}" in stderr
    assert not (tmp_path / "out").exists()


def test_a_class_number_past_the_index_is_named_by_verify_and_by_training(packed, tmp_path):
    """An index whose class list is shorter than the labels: verify says which shards hold
    such a label (exit 1), and training stops on the first one, naming its shard and key
    (BadShard: exit 2), where the loss would fail with an IndexError."""
    from ddpcli.data.shards.index import read_index
    from ddpcli.data.shards.plan import fresh_plan, shard_table, whole_streams
    from ddpcli.data.shards.storage import shard_store
    from ddpcli.data.shards.stream import BadShard, part_samples

    _, out, _ = packed
    copy = tmp_path / "copy"
    copy.mkdir()
    for name, data in all_files(out).items():
        (copy / name).write_bytes(data)
    document = json.loads((copy / "index.json").read_text())
    for split in document["splits"].values():
        split["classes"] = CLASSES[:2]  # class 2 (dog) has no name
    (copy / "index.json").write_text(json.dumps(document))

    result = invoke("data", "verify", str(copy), "--json", "--workers", "1")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    with_dogs = {
        name
        for name, data in all_files(copy).items()
        if name.endswith(".tar") and b"2" in shard_members(copy / name).values()
    }
    assert with_dogs and set(report["bad"]) == with_dogs
    for check in report["shards"]:
        if check["name"] in with_dogs:
            assert check["status"] == "bad-label", check
            assert ".cls holds '2', and the index names 2 classes (0 to 1)" in check["detail"]
    assert "bad-label" in result.stderr and "Traceback" not in result.stderr

    table = shard_table(read_index(copy).splits["train"])
    plan = fresh_plan(table, 0, 0, 1, 1, 1)
    with pytest.raises(BadShard) as raised:
        list(part_samples(shard_store(copy), table, plan, whole_streams(plan)))
    said = raised.value.message
    assert raised.value.exit_code == 2
    shard = rf"shard {copy}/train-\d{{6}}\.tar"
    assert re.match(rf"{shard} gives train/dog/img\S+ class number 2, and the index names 2 "
                    r"classes \(0 to 1\): it does not match", said), said  # fmt: skip


def test_a_slow_pack_is_asked_for_in_seconds(tmp_path):
    from ddpcli.config.data import build_pack_config
    from ddpcli.errors import DdpcliError

    flags = {"src": tmp_path, "out": tmp_path / "out"}
    assert build_pack_config(flags, environ={"DDPCLI_SLOW_PACK": "0.5"}).slow_pack == 0.5
    assert build_pack_config(flags, environ={}).slow_pack == 0
    for wrong in ("soon", "-1", "nan"):
        with pytest.raises(DdpcliError, match="invalid DDPCLI_SLOW_PACK: give SECONDS"):
            build_pack_config(flags, environ={"DDPCLI_SLOW_PACK": wrong})


def test_sizes_and_keys():
    assert parse_size("256MB") == 256 << 20 and parse_size("1G") == 1 << 30
    assert parse_size("4096") == 4096
    assert sample_key(PurePath("train/cat/img001.jpg")) == "train/cat/img001"
    # Dots and escapes never meet: two different names stay two different keys.
    assert sample_key(PurePath("train/n.1/a.b.jpg")) == "train/n%2E1/a%2Eb"
    assert sample_key(PurePath("train/c/a%2Eb.jpg")) == "train/c/a%252Eb"


def job_processes(tag: str) -> list[int]:
    """Every process whose environment holds TAG: the command, its fork server and resource
    tracker, and the workers (forked from the server, with its environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and tag.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue  # one that just ended, or not ours to read
    return found


def processes_left(tag: str, grace_s: float) -> list[str]:
    """The command lines of TAG's processes still running after GRACE_S seconds."""
    deadline = time.monotonic() + grace_s
    while job_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = []
    for pid in job_processes(tag):
        with contextlib.suppress(OSError):
            left.append((Path("/proc") / str(pid) / "cmdline").read_bytes().decode()[:120])
    return left


def end_job(run: LiveProcess, tag: str) -> None:
    """SIGTERM to the process group and to every process of the job (those that left the
    group too), then SIGKILL to what ignored it: nothing of a job outlives its test."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(run.process.pid, signum)
        for pid in job_processes(tag):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
        time.sleep(0.2)
    run.kill()


def test_ctrl_c_leaves_no_partial_shard_no_index_and_no_process(tmp_path):
    """Workers are stopped at once; nothing half-written is left, no index names an
    incomplete set (the next pack starts over), and no process of the pack is left (fork
    server, resource tracker, workers). Each sample waits a second in its shard's temporary
    file (DDPCLI_SLOW_PACK): the Ctrl-C lands mid-pack however busy the machine."""
    for name in CLASSES[:2]:
        for split, count in (("train", 20), ("val", 1)):
            folder = tmp_path / "src" / split / name
            folder.mkdir(parents=True)
            for number in range(count):
                (folder / f"{number}.jpg").write_bytes(bytes(2 << 10))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "ddpcli", "data", "pack", str(tmp_path / "src"), str(out)]
    command += ["--shard-size", "1K", "--workers", "2"]  # one sample a shard: 42 shards
    tag = f"DDPCLI_TEST_JOB={tmp_path.name}"
    run = LiveProcess(command, clean_env(DDPCLI_SLOW_PACK="1", DDPCLI_TEST_JOB=tmp_path.name))
    try:
        deadline = time.monotonic() + 60
        while not list(out.glob("train-*.tar")) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(run.process.pid, signal.SIGINT)
        code = run.finish(timeout=30)
        left_running = processes_left(tag, grace_s=5)
    finally:
        end_job(run, tag)
    assert code == 130, run.stderr
    assert not left_running, left_running
    assert "interrupted" in run.stderr and "Traceback" not in run.stderr
    left = sorted(path.name for path in out.iterdir() if path.name != PENDING_NAME)
    assert "index.json" not in left and all(name.endswith(".tar") for name in left), left
    assert 1 <= len(left) < 40, left  # whole shards only, and stopped well before the end
    for name in left:  # each shard whole: its one sample's image, all of it, and its label
        with tarfile.open(out / name) as shard:
            members = {Path(member.name).suffix: member.size for member in shard.getmembers()}
        assert members.keys() == {".jpg", ".cls"} and members[".jpg"] == 2 << 10, (name, members)
    # The shards it wrote are listed as a pack's: the next pack starts over, unasked.
    assert (out / PENDING_NAME).is_file()
    again = invoke("data", "pack", str(tmp_path / "src"), str(out), "--shard-size", "1K",
                   "--workers", "1")  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert len(list(out.glob("*.tar"))) == 42 and not (out / PENDING_NAME).exists()


def test_ctrl_c_while_the_pool_starts_its_workers_leaves_none(monkeypatch):
    """The window where a Ctrl-C left a worker that no one ended (and with it the fork
    server and the resource tracker, for good; or an exit that waited for it forever): the
    first worker started and waiting for tasks, the pool not yet told. Here the Ctrl-C
    comes at that moment each time."""
    from multiprocessing.process import BaseProcess

    from ddpcli.data.shards.parallel import run_parallel

    started: list[int] = []
    start = BaseProcess.start

    def start_then_ctrl_c(process: BaseProcess) -> None:
        start(process)
        started.append(process.pid or 0)
        if len(started) == 1:
            time.sleep(1)  # the worker set up, waiting for its first task
            os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(BaseProcess, "start", start_then_ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_parallel(abs, [-1, -2, -3, -4], 2)
        monkeypatch.undo()
        deadline = time.monotonic() + 5
        while any(running(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started and not [pid for pid in started if running(pid)], started
    finally:
        signal.signal(signal.SIGINT, previous)
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def running(pid: int) -> bool:
    """PID is a live process (not a zombie its parent has yet to reap)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
