"""`ddpcli train --dataset shards`: an epoch planned from the index alone, streamed by every
rank's loader workers, each sample once; stopped mid-epoch at 3 ranks and resumed at 2 from
the checkpoint's stream position, each sample still once; an elastic host that joins, then
is lost inside an epoch, the other going on alone, each sample still once; the bad inputs
said in one line."""

from __future__ import annotations

import gc
import io
import itertools
import json
import re
import sys
import tarfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest
from conftest import (
    LiveProcess,
    clean_env,
    free_port,
    read_metrics,
    run_cli,
    traced_counts,
    traced_records,
    write_noise_folder,
)
from test_faults import assert_no_worker_left, descendants, kill_pid

from ddpcli.checkpoint.loading import safe_load
from ddpcli.data.shards.index import (
    ShardIndex,
    ShardRecord,
    SplitIndex,
    index_document,
    index_from_document,
    read_index,
    split_stamp,
)
from ddpcli.data.shards.plan import (
    after_consumed,
    deal,
    fresh_plan,
    pieces_length,
    shard_table,
    whole_streams,
)
from ddpcli.data.shards.storage import shard_store
from ddpcli.data.shards.stream import BadShard, part_samples, shard_samples

PER_CLASS = 12  # 3 classes: 36 train and 36 val images
BAD_KEY = "train/owl/5"  # written as a file that is no image


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """36 train and 36 val images of 16 px in shards of about 9 samples (4 train shards: fewer
    than 3 ranks x 2 workers' streams), one train member undecodable."""
    root = tmp_path_factory.mktemp("shards")
    write_noise_folder(root / "src", per_class=PER_CLASS)
    (root / "src" / f"{BAD_KEY}.png").write_bytes(b"not a png")
    out = root / "out"
    result = run_cli("data", "pack", str(root / "src"), str(out), "--shard-size", "24KB")
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def all_numbers(out: Path, split: str = "train") -> list[int]:
    return list(range(read_index(out).splits[split].samples))


# --- The plan: pure arithmetic, and the streams read back ---------------------------------


def test_any_world_deals_the_rest_of_an_epoch_so_each_sample_is_read_once(packed):
    """The fresh epoch at 3 ranks x 2 workers, some outputs of each part trained, the rest dealt
    at 2 x 1 and at 1 x 3: the streams replayed through their seeded buffers give every
    sample exactly once."""
    store, table = shard_store(packed), shard_table(read_index(packed).splits["train"])
    plan = fresh_plan(table, seed=0, epoch=1, ranks=3, workers=2, buffer=4)
    assert len(plan.streams) == 6 and len(table.names) < 6  # fewer shards than streams

    def numbers(parts) -> list[int]:
        return [s.number for part in parts for s in part_samples(store, table, plan, part)]

    parts = [part for rank in deal(whole_streams(plan), 3, 2) for part in rank]
    fresh = numbers(parts)
    assert sorted(fresh) == all_numbers(packed)
    assert fresh != sorted(fresh)  # the shard order and the buffers shuffle
    consumed = [3, 0, 5, 1, 2, 6]
    trained = [
        n for part, done in zip(parts, consumed, strict=True) for n in numbers([part])[:done]
    ]
    left = after_consumed(parts, consumed)
    assert pieces_length(left) == len(fresh) - sum(consumed)
    for ranks, workers in ((2, 1), (1, 3), (4, 2)):
        rest = numbers([part for rank in deal(left, ranks, workers) for part in rank])
        assert Counter(trained + rest) == Counter(fresh), (ranks, workers)


def test_a_shard_cut_short_or_unlike_its_index_is_named(packed, tmp_path):
    index = read_index(packed)
    name = index.splits["train"].shards[0].name
    data = (packed / name).read_bytes()
    (tmp_path / name).write_bytes(data[: len(data) // 2])
    table = shard_table(index.splits["train"])
    plan = fresh_plan(table, 0, 0, 1, 1, 1)
    first = [(0, 0, table.counts[0])]
    plan.order = list(range(len(table.names)))  # shard 0 first
    # Cut inside a member or between two: either way named, and said to be cut short.
    with pytest.raises(BadShard, match=rf"^shard {tmp_path}/{name} .*cut short.*: it does not "
                       rf"match {tmp_path}/index.json; check the shards with `ddpcli data "
                       rf"verify {tmp_path}`"):  # fmt: skip
        list(part_samples(shard_store(tmp_path), table, plan, first))
    with tarfile.open(tmp_path / name, "w") as tar:  # a whole tar of one sample
        for member, data in (("a.png", b"png"), ("a.cls", b"0")):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(BadShard, match=rf"holds 1 samples, the index says {table.counts[0]}"):
        list(part_samples(shard_store(tmp_path), table, plan, first))


def test_the_plan_holds_no_per_sample_state(packed):
    """The index, the plan and the position of 1.28 M samples (5000 shards of 256) take a few
    MB, and ten times the samples per shard take the same: nothing grows with the samples
    (docs/train.md). Measured with the collector paused (a collection inside the traced span
    moved the figure by 4 %), and the growth between counts above 256: Python keeps one
    shared object for each int up to 256, so 5000 counts of 256 allocate nothing, 140 kB less
    than 5000 of 2560."""

    def resident(per_shard: int) -> int:
        records = [ShardRecord(f"train-{n:06d}.tar", per_shard, 1 << 28, "0" * 64)
                   for n in range(5000)]  # fmt: skip
        document = index_document(ShardIndex("imagefolder", 0, 1 << 28, {
            "train": SplitIndex(["a", "b"], records), "val": SplitIndex(["a", "b"], records[:50]),
        }))  # fmt: skip
        text = json.dumps(document)
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            index = index_from_document(json.loads(text))
            table = shard_table(index.splits["train"])
            plan = fresh_plan(table, 0, 3, ranks=64, workers=8, buffer=1000)
            parts = [part for rank in deal(whole_streams(plan), 64, 8) for part in rank]
            consumed = after_consumed(parts, [7] * len(parts))
            position = {"plan": plan.document(), "pieces": consumed}
            size, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            gc.enable()
        assert table.samples == 5000 * per_shard and position
        return size

    assert resident(256) < 8 << 20
    assert resident(25600) == pytest.approx(resident(2560), rel=0.01)


# --- Training: 3 ranks stopped inside epoch 1, resumed at 2 --------------------------------

SETTINGS = [
    "--cpu", "--arch", "tinycnn", "--image-size", "16", "--per-gpu-batch", "2", "--epochs", "2",
    "--timeout", "60", "--skip-bad-images", "--shuffle-buffer", "3",
]  # fmt: skip


def test_stopped_at_3_ranks_and_resumed_at_2_each_sample_once(packed, tmp_path, in_process):
    out, trace = tmp_path / "run", tmp_path / "trace"
    env = {"DDPCLI_TRACE_SAMPLES": str(trace)}
    # No --dataset: a --data-dir that holds index.json is read as shards.
    first = run_cli("train", *SETTINGS, "--data-dir", str(packed), "--nproc", "3",
                    "--workers", "2", "--max-steps", "2", "--out", str(out), env=env,
                    timeout=240)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    said = first.stderr
    good = sorted(set(all_numbers(packed)) - {bad_number(packed)})  # 35 of 36
    assert "tinycnn on shards at 16 px · 35 train samples per epoch, each once (each rank's " \
        "last micro-batch takes its rest: 3 to 4) / 36 val samples" in said  # fmt: skip
    assert "cut into 6 streams (3 ranks x 2 loader workers); 4 shards for 6 streams: split by " \
        "samples, so a stream may begin and end inside a shard; shuffle buffer 3 samples per " \
        "stream" in said  # fmt: skip
    assert "every rank runs 5 micro-batches, its last one holding the rest of its share" in said
    assert f".tar:{BAD_KEY}); all of them in {out}/skipped_images.txt" in said
    position = safe_load(out / "checkpoints" / "last.pt")["stream_position"]
    pieces = [tuple(piece) for piece in position["pieces"]]
    assert len(position["plan"]["streams"]) == 6 and pieces_length(pieces) == 35 - 2 * 2 * 3
    assert position["index"] == split_stamp(read_index(packed).splits["train"])
    refuse_a_resume_over_other_shards(packed, out, tmp_path, in_process)

    second = run_cli("train", *SETTINGS, "--data-dir", str(packed), "--nproc", "2",
                     "--workers", "1", "--resume", "auto", "--out", str(out), env=env,
                     timeout=240)  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert "epoch 1: 12 of 35 samples trained before the resume; the other 23 dealt from the " \
        "saved stream position over 2 ranks x 1 streams, 5 batches of 2 each, the last of them " \
        "3 to 4 (the tail folded in)" in second.stderr  # fmt: skip
    assert traced_counts(trace, 3, epoch=0) == Counter(good)  # each sample of epoch 1 once
    assert traced_counts(trace, 3, epoch=1) == Counter(good)  # and of epoch 2, at 2 ranks
    metrics = read_metrics(out)
    assert [(m["epoch"], m["world_size"]) for m in metrics] == [(1, 2), (2, 2)]
    assert {m["val_samples"] for m in metrics} == {36}  # every val sample once, unpadded


def test_a_host_joining_then_lost_mid_epoch_and_each_sample_is_still_trained_once(packed, tmp_path):
    """Elastic membership (`--nnodes 1:2`): a host trains alone (slowed, so that the second
    arrives mid-run); the second joins, the first stops at an agreed step and saves its stream
    position, and both go on as a world of 2 from it. Inside an epoch, after the world of 2
    saved in it (every 2 steps), the second host is lost (every process of it SIGKILLed): the
    first restarts alone from that checkpoint's stream position. Each epoch trains each sample
    exactly once: the batches the lost world handed out after that checkpoint are the only
    ones trained again (and a join after the first host's last but one micro-batch of an
    epoch leaves that epoch's last 2 or 3 out, as the resume says). The join comes in epoch 1
    or 2, wherever the second host's start takes it: each trace record says its world, and
    the accounting reads the rounds from them, not from the timing."""
    out, trace, endpoint = tmp_path / "run", tmp_path / "trace", f"127.0.0.1:{free_port()}"
    command = [
        sys.executable, "-m", "ddpcli", "train", "--cpu", "--arch", "tinycnn", "--image-size",
        "16", "--per-gpu-batch", "2", "--epochs", "3", "--log-every", "1", "--skip-bad-images",
        "--shuffle-buffer", "3", "--data-dir", str(packed), "--nproc", "1", "--nnodes", "1:2",
        "--rdzv-endpoint", endpoint, "--timeout", "60", "--max-restarts", "1",
        "--save-every-steps", "2", "--out", str(out),
    ]  # fmt: skip
    env = {**clean_env(), "DDPCLI_TRACE_SAMPLES": str(trace), "DDPCLI_SLOW_DATA": "0:0.25"}
    first = LiveProcess(command, env)
    second = None
    try:
        first.wait_for("epoch 1/3 step", timeout=150)
        second = LiveProcess(command, env)
        wait_for_the_pair_inside_an_epoch(first, timeout=150)
        lose_host(second)
        codes = [first.finish(180)]
    finally:
        for node in (first, second):
            if node is not None:
                lose_host(node)
                node.kill()
    resumes = "".join(line for line in first.lines if "resume" in line)  # what each round took
    logs = f"{resumes}...\n{first.stderr[-3000:]}\n---\n{second.stderr[-1500:]}"
    assert codes == [0], logs
    assert_no_worker_left(out)
    assert "a new round of the job: resuming from the last checkpoint" in first.stderr, logs
    lost = re.search(
        r"epoch (\d): (\d+) of 35 samples trained before the resume; the other \d+ dealt from "
        r"the saved stream position over 1 ranks",
        first.stderr,
    )
    assert lost, logs
    lost_epoch, resumed = int(lost[1]) - 1, int(lost[2])
    good = Counter(sorted(set(all_numbers(packed)) - {bad_number(packed)}))
    for epoch in set(range(3)) - {lost_epoch}:  # once each: all of them where none is left out
        counts = traced_counts(trace, 2, epoch)
        assert set(counts.values()) == {1} and counts.keys() <= good.keys(), (epoch, logs)
        assert counts.total() == 35 - left_out(first.stderr, epoch), (epoch, logs)
    assert kept_in_epoch(trace, lost_epoch, resumed, batch=2) == good, (lost_epoch, logs)
    # The survivor ends every epoch from the one it restarted in.
    worlds = [m["world_size"] for m in read_metrics(out)]
    assert len(worlds) == 3 and worlds[lost_epoch:] == [1] * (3 - lost_epoch), logs


def refuse_a_resume_over_other_shards(packed: Path, out: Path, tmp_path: Path, in_process) -> None:
    """The same images packed again (another --seed: the same counts, other contents; another
    --shard-size: other counts): the checkpoint's stream position counts the samples of the
    shards it was saved with, so the rest of its epoch would train some twice and others
    never. Refused before any worker starts (exit 2, one line, saying what changed), and by
    every rank that reads the position (a launcher that skipped the check)."""
    from ddpcli.data.shards.checks import check_resumed_index
    from ddpcli.errors import DdpcliError

    checkpoint = out / "checkpoints" / "last.pt"
    for name, size, seed in (("seed", "24KB", "3"), ("size", "40KB", "0")):
        again = tmp_path / f"repacked-{name}"
        result = in_process("data", "pack", str(packed.parent / "src"), str(again),
                            "--shard-size", size, "--seed", seed, "--workers", "1")  # fmt: skip
        assert result.returncode == 0, result.stderr
        result = in_process("train", *SETTINGS, "--data-dir", str(again), "--nproc", "2",
                            "--resume", "auto", "--out", str(out), "--dry-run")  # fmt: skip
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr
        assert lines[0].startswith(
            f"error: cannot resume from {checkpoint} inside epoch 1: the "
            f"train shards at {again} are not those it was saved with ("
        )
        if name == "seed":
            assert "shards of 36 samples, other contents)" in lines[0], lines[0]
        else:
            assert re.search(r"\(4 shards of 36 samples then, \d shards of 36 samples now\)",
                             lines[0]), lines[0]  # fmt: skip
        assert "some would be trained twice, others never" in lines[0]
        position = safe_load(checkpoint)["stream_position"]
        with pytest.raises(DdpcliError) as raised:
            stamp = split_stamp(read_index(again).splits["train"])
            check_resumed_index(position, stamp, shard_store(again), "the checkpoint")
        assert raised.value.exit_code == 2 and raised.value.every_rank


# The world of 2's progress lines (a world of 1 runs 17 micro-batches an epoch), and the
# join's resume line where the join came inside an epoch: the world of 2 trains B of it.
PAIR_STEP = re.compile(r"^epoch (\d)/3 step (\d+)/8 ", re.MULTILINE)
JOINED_INSIDE = re.compile(
    r"epoch (\d): \d+ of 35 samples trained before the resume; the other \d+ dealt from the "
    r"saved stream position over 2 ranks x 1 streams, (\d+ batches|one batch)"
)


def wait_for_the_pair_inside_an_epoch(node: LiveProcess, timeout: float) -> None:
    """Until the world of 2 has trained 3 micro-batches of an epoch with 2 or more to go: the
    save at its first or second step is complete (both ranks went on past it), and a host
    lost now is lost inside the epoch, not at its end. It trains 8 of an epoch it starts,
    B of the one it joined inside."""
    deadline = time.monotonic() + timeout
    while not pair_inside_an_epoch(node.stderr):
        if node.process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the world of 2 never trained inside an epoch:\n{node.stderr}")
        time.sleep(0.05)


def pair_inside_an_epoch(log: str) -> bool:
    joined = JOINED_INSIDE.search(log)
    for epoch, step in PAIR_STEP.findall(log):
        batches = joined[2].split()[0] if joined and joined[1] == epoch else "8"
        in_epoch = 1 if batches == "one" else int(batches)
        if 3 <= int(step) <= in_epoch - 2:
            return True
    return False


def left_out(log: str, epoch: int) -> int:
    """Samples of EPOCH that no rank trains, as the resume says: a join after the first
    host's last but one micro-batch leaves its last one's 2 or 3, too few for a batch of 2
    on each of 2 ranks (docs/checkpoints.md: the least a training batch holds)."""
    said = re.search(
        rf"epoch {epoch + 1}: \d+ of 35 samples trained before the resume; the other (\d+) "
        r"left out \(too few for a batch of 2 on each of 2 ranks",
        log,
    )
    return int(said[1]) if said else 0


def lose_host(node: LiveProcess) -> None:
    """Every process of NODE (its agent, fork server, ranks and their loader workers) killed
    at once, as when a machine is lost: all found before any is killed (an orphan is no
    longer found as a descendant)."""
    for pid in [node.process.pid, *descendants(node.process.pid)]:
        kill_pid(pid)


def kept_in_epoch(trace: Path, epoch: int, resumed: int, batch: int) -> Counter:
    """EPOCH's samples as the job kept them, where the survivor restarted inside it from a
    checkpoint that held RESUMED of its samples. Each record says its world: rank 0's of the
    epoch are the first host's alone (world 1; none where the join came before the epoch),
    then the world of 2's, then the survivor's (world 1); rank 1's are all the world of 2's.
    The checkpoint held the first host's and the world of 2's first (RESUMED - the first
    host's) / (2 x BATCH) batches on each rank: its later ones were handed out after it,
    lost with the host, and trained again by the survivor."""
    rank_0, rank_1 = (traced_records(trace, rank, epoch) for rank in (0, 1))
    runs = [list(run) for _, run in itertools.groupby(rank_0, key=lambda r: r["world"])]
    worlds = [run[0]["world"] for run in runs]
    assert worlds in ([1, 2, 1], [2, 1]), worlds
    alone, pair, survivor = runs if len(runs) == 3 else [[], *runs]
    saved, rest = divmod(resumed - sum(len(record["indices"]) for record in alone), 2 * batch)
    assert rest == 0 and saved <= min(len(pair), len(rank_1)), (resumed, runs, rank_1)
    kept = alone + pair[:saved] + rank_1[:saved] + survivor
    return Counter(n for record in kept for n in record["indices"])


def bad_number(out: Path) -> int:
    """The sample number of BAD_KEY: its shard's first number + its position there."""
    split = read_index(out).splits["train"]
    first = 0
    for record in split.shards:
        keys = tar_keys(out / record.name)
        if BAD_KEY in keys:
            return first + keys.index(BAD_KEY)
        first += record.samples
    raise AssertionError(f"{BAD_KEY} is in no shard")


def tar_keys(path: Path) -> list[str]:
    with tarfile.open(path) as tar:
        return list(dict.fromkeys(member.name.partition(".")[0] for member in tar))


# --- Bad input: exit 2, one line, before any worker starts ---------------------------------


def copy_of(packed: Path, folder: Path) -> Path:
    folder.mkdir()
    for path in packed.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    return folder


def train_on(in_process, folder: Path, *extra: str):
    return in_process("train", "--cpu", "--nproc", "2", "--dataset", "shards", "--data-dir",
                      str(folder), "--dry-run", *extra)  # fmt: skip


def test_bad_shards_and_indexes_exit_2_with_one_line(packed, tmp_path, in_process):
    truncated = copy_of(packed, tmp_path / "truncated")
    shard = truncated / "train-000002.tar"
    shard.write_bytes(shard.read_bytes()[:1000])
    result = train_on(in_process, truncated)
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: shard {shard} holds 1,000 bytes, index.json says")
    )
    assert "the index does not match its shards" in result.stderr

    empty = copy_of(packed, tmp_path / "empty")
    document = json.loads((empty / "index.json").read_text())
    document["splits"]["val"]["shards"] = []
    (empty / "index.json").write_text(json.dumps(document))
    result = train_on(in_process, empty)
    assert result.returncode == 2 and "its val split is empty" in result.stderr
    assert "Traceback" not in result.stderr

    result = train_on(in_process, packed, "--ra-reps", "2")
    assert result.returncode == 2 and "invalid --ra-reps" in result.stderr


def test_an_undecodable_member_is_named_as_shard_and_key(packed):
    """Without --skip-bad-images the member stops the run (exit 2: UnreadableImage, raised in
    a loader worker as for image folders), named as `shard:key`."""
    from ddpcli.data.decode import UnreadableImage
    from ddpcli.data.shards.feed import MemberImages

    table = shard_table(read_index(packed).splits["train"])
    shard = next(n for n, name in enumerate(table.names) if BAD_KEY in tar_keys(packed / name))
    samples = shard_samples(shard_store(packed), table, shard, 0, table.counts[shard])
    bad = next(sample for sample in samples if sample.name.endswith(BAD_KEY))
    with pytest.raises(UnreadableImage) as raised:
        MemberImages(16, 0, "rrc").image(bad, epoch=0)
    assert raised.value.message.startswith(f"cannot decode image {table.names[shard]}:{BAD_KEY}: ")
    assert raised.value.exit_code == 2 and "--skip-bad-images" in raised.value.message
