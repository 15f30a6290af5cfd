"""A world that changes size loses nothing: the rest of the interrupted epoch is dealt over
the new ranks from the checkpoint's global sample offset, each sample to exactly one rank,
the tail that fills no global batch folded into each rank's last micro-batch.

Pure arithmetic first (the offset, the split, the batch policy), then one run stopped inside
its first epoch at 3 ranks and resumed at 2, checked from the samples each rank trained.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, run_cli, traced_counts, write_noise_folder
from test_speed_paths import assert_same_batches, collect, context, pipeline, tiny_config

from ddpcli.checkpoint.loading import safe_load
from ddpcli.checkpoint.schema import resumed_position, sample_offset, world_change_line
from ddpcli.config import TrainConfig
from ddpcli.config.plan import RunPlan
from ddpcli.config.train import accumulate_keeping
from ddpcli.data.pipeline import train_shard
from ddpcli.data.ra_sampler import repeated_shard
from ddpcli.data.resharding import (
    LEAST_BATCH,
    epoch_order,
    left_out,
    remaining_batch_sizes,
    remaining_shard,
    remaining_steps,
    samples_trained,
    split_in_batches,
)
from ddpcli.dist import DistContext
from ddpcli.launcher.plan import plan_run
from ddpcli.training.settle import accumulation_after

# (set size, old world, new world, per-process batch, micro-batches trained at the old world)
CASES = [
    (96, 3, 2, 4, 3),
    (97, 3, 2, 4, 3),  # DistributedSampler pads 97 to 99 at 3 ranks
    (100, 4, 3, 5, 2),
    (101, 2, 5, 3, 7),
    (64, 2, 4, 8, 1),
    (50, 1, 3, 4, 5),
    (30, 3, 4, 2, 0),
]


def shard_at(size: int, world: int, rank: int, seed: int, epoch: int) -> list[int]:
    ctx = DistContext(rank, rank, world, world, 0, torch.device("cpu"), "gloo")
    return train_shard(size, ctx, seed, epoch)


@pytest.mark.parametrize(("size", "old", "new", "batch", "done"), CASES)
def test_the_rest_of_an_epoch_is_dealt_once_over_the_new_ranks(size, old, new, batch, done):
    seed, epoch = 3, 2
    order = epoch_order(size, seed, epoch)
    trained = [
        index
        for rank in range(old)
        for index in shard_at(size, old, rank, seed, epoch)[: done * batch]
    ]
    offset = samples_trained(0, done, batch, old)
    # What DistributedSampler handed out so far is exactly the order's first OFFSET samples.
    assert sorted(trained) == sorted(order[:offset])
    shards = [remaining_shard(order, offset, new, rank, batch) for rank in range(new)]
    sizes = [remaining_batch_sizes(size, offset, new, rank, batch) for rank in range(new)]
    steps = remaining_steps(size, offset, new, batch)
    assert all(len(lengths) == steps for lengths in sizes)  # the same steps on every rank
    assert [len(shard) for shard in shards] == [sum(lengths) for lengths in sizes]
    rest = Counter(index for shard in shards for index in shard)
    assert max(rest.values(), default=1) == 1 and not rest.keys() & set(trained)
    assert left_out(size, offset, new, batch) == 0
    # Everything not trained before is trained now, the tail too.
    assert sorted(rest) == sorted(order[offset:])


def rest_chunks(size: int, start: int, world: int, batch: int) -> list[list[list[int]]]:
    """Each rank's micro-batches of the rest, as lists of positions in the epoch's order."""
    ranks = []
    for rank in range(world):
        positions = list(range(start + rank, size, world))
        chunks, end = [], 0
        for length in remaining_batch_sizes(size, start, world, rank, batch):
            chunks.append(positions[end : end + length])
            end += length
        ranks.append(chunks)
    return ranks


def test_every_position_of_the_rest_lands_in_exactly_one_micro_batch():
    for size in (7, 16, 33, 96, 101):
        for start in range(1, size):
            for world in (1, 2, 3, 5):
                for batch in (1, 2, 4, 7):
                    ranks = rest_chunks(size, start, world, batch)
                    steps = remaining_steps(size, start, world, batch)
                    where = (size, start, world, batch)
                    assert all(len(chunks) == steps for chunks in ranks), where
                    seen = [p for chunks in ranks for chunk in chunks for p in chunk]
                    assert len(seen) == len(set(seen)), where
                    dropped = left_out(size, start, world, batch)
                    assert sorted(seen) == list(range(start, size - dropped)), where
                    lengths = [len(chunk) for chunks in ranks for chunk in chunks]
                    assert min(lengths, default=LEAST_BATCH) >= LEAST_BATCH or batch == 1, where
                    # Full micro-batches but the last, which holds the tail; nothing is left
                    # out unless some rank would hold fewer than LEAST_BATCH.
                    assert all(
                        chunk == batch for chunks in ranks for chunk in map(len, chunks[:-1])
                    )
                    least_share = (size - start) // world
                    assert (dropped > 0) == (least_share < min(batch, LEAST_BATCH)), where
                    if least_share >= batch:
                        assert all(batch <= len(c[-1]) <= 2 * batch for c in ranks), where


def test_the_tail_is_folded_into_the_last_micro_batch():
    # 96 samples, 36 trained: 60 over 2 ranks, 30 each: 6 batches of 4, then one of 6.
    assert remaining_batch_sizes(96, 36, 2, 0, 4) == [4] * 6 + [6]
    # 61 left over 2 ranks: rank 0 holds 31, rank 1 30; the last batches differ by one.
    assert remaining_batch_sizes(97, 36, 2, 0, 4) == [4] * 6 + [7]
    assert remaining_batch_sizes(97, 36, 2, 1, 4) == [4] * 6 + [6]
    # Less than a global batch left: one micro-batch each of what there is, from 2 up.
    assert remaining_batch_sizes(96, 90, 2, 1, 4) == [3]
    assert remaining_batch_sizes(96, 93, 2, 0, 4) == remaining_batch_sizes(96, 93, 2, 1, 4) == []
    assert left_out(96, 93, 2, 4) == 3 and left_out(96, 92, 2, 4) == 0


def test_an_ordinary_epoch_keeps_full_batches_and_drops_its_last_partial_one():
    assert split_in_batches(35, 4, drop_last=True) == [4] * 8
    assert split_in_batches(35, 4, drop_last=False) == [4] * 8 + [3]
    assert split_in_batches(32, 4, drop_last=False) == [4] * 8


@pytest.mark.parametrize("rank", [0, 1])
def test_both_data_paths_fold_the_tail_into_the_last_batch_alike(tmp_path, rank):
    # 52 images, 18 trained before: 34 over 2 ranks, 17 each, in batches of 8 then 9.
    cfg = tiny_config(tmp_path, random_erase=0.5)
    ctx = context(rank, world_size=2)
    device_path, loader_path = pipeline(cfg, ctx, True), pipeline(cfg, ctx, False)
    want = collect(device_path.train_batches(0, start=18))
    assert [len(labels) for _, labels in want] == [8, 9] and device_path.steps_per_epoch(18) == 2
    assert_same_batches(collect(loader_path.train_batches(0, start=18)), want)
    # An exact resume inside the re-dealt rest skips its full batches and keeps the tail.
    assert_same_batches(collect(loader_path.train_batches(0, 1, start=18)), want[1:])
    # An ordinary epoch is unchanged: 26 keys a rank, 3 full batches, the 2 left dropped.
    assert [len(labels) for _, labels in collect(loader_path.train_batches(0))] == [8, 8, 8]


def test_a_second_change_inside_the_same_epoch_goes_on_from_its_own_offset():
    size, batch, seed, epoch = 101, 3, 0, 0
    order = epoch_order(size, seed, epoch)
    first = samples_trained(0, 4, batch, 3)  # 3 ranks, 4 micro-batches
    two = [remaining_shard(order, first, 2, rank, batch)[: 5 * batch] for rank in range(2)]
    second = samples_trained(first, 5, batch, 2)  # then 2 ranks, 5 micro-batches
    four = [remaining_shard(order, second, 4, rank, batch) for rank in range(4)]
    seen = order[:first] + [i for shard in two + four for i in shard]
    assert len(seen) == len(set(seen)) == size


def test_the_order_is_the_samplers_own_with_and_without_ra_reps():
    size, world, seed, epoch = 97, 3, 5, 2
    order = epoch_order(size, seed, epoch)
    keys = epoch_order(size, seed, epoch, reps=3)
    for rank in range(world):
        shard = shard_at(size, world, rank, seed, epoch)
        assert shard[:32] == order[rank::world][:32]  # all but the padded tail
        assert repeated_shard(size, world, rank, seed, epoch, 3)[:32] == keys[rank::world][:32]


def test_the_offset_of_a_file_from_before_it_was_recorded_is_derived():
    old = {"batch_in_epoch": 3, "world_size": 3, "epoch_start": 0, "config": {"per_gpu_batch": 4}}
    del old["epoch_start"]
    assert sample_offset(old) == 36
    assert resumed_position(old, world_size=3, per_gpu_batch=4) == (0, 3)  # exact, as before
    assert resumed_position(old, world_size=2, per_gpu_batch=4) == (36, 0)
    assert resumed_position(old, world_size=3, per_gpu_batch=2) == (36, 0)  # another batch
    # A file the re-dealt world wrote continues its own deal at that world.
    again = {"batch_in_epoch": 2, "world_size": 2, "epoch_start": 36, "sample_offset": 52,
             "config": {"per_gpu_batch": 4}}  # fmt: skip
    assert resumed_position(again, world_size=2, per_gpu_batch=4) == (36, 2)
    assert resumed_position(again, world_size=4, per_gpu_batch=4) == (52, 0)


def planned(world: int, per_gpu_batch: int, **flags) -> RunPlan:
    request = TrainConfig(arch="tinycnn", cpu=True, nproc=world, per_gpu_batch=per_gpu_batch,
                          **flags)  # fmt: skip
    return plan_run(request, None)


def saved_config(world: int, per_gpu_batch: int, accumulate: int = 1) -> dict:
    return planned(world, per_gpu_batch, accumulate=accumulate).model_dump(mode="json")


def resumed(saved: dict, saved_world: int, world: int, **flags) -> dict:
    """What a rank of WORLD settles (ddpcli.training.settle) resuming from SAVED."""
    plan = planned(world, 16, **flags)
    accumulate, requested = accumulation_after(plan, saved, saved_world, world)
    peak_lr = plan.model_copy(update={"accumulate": accumulate}).peak_lr_at(world)
    settled = {"accumulate": accumulate, "requested_accumulate": requested, "peak_lr": peak_lr}
    return {**plan.model_dump(mode="json"), **settled}


def test_a_divisible_world_keeps_the_global_batch_by_accumulating():
    assert accumulate_keeping(64, 16, 2) == 2 and accumulate_keeping(48, 16, 2) is None
    saved = saved_config(4, 16)
    now = resumed(saved, 4, 2)
    assert now["accumulate"] == 2 and now["peak_lr"] == saved["peak_lr"]
    line = world_change_line({"world_size": 4, "config": saved}, now, 2)
    assert line.startswith("world 4 -> 2: global batch 64 -> 64 (kept), accumulate 1 -> 2")
    assert "peak lr 0.05 -> 0.05" in line  # tinycnn: 0.2 per 256 images, linear
    # Growing back: 2 x 16 x 2 at 4 ranks is 4 x 16 x 1.
    assert resumed(now, 2, 4)["accumulate"] == 1
    # A restart at the same world (the command still says --accumulate 1) keeps what the
    # policy set, not the command's 1; a new --accumulate on the command is taken as given.
    again = resumed(now, 2, 2)
    assert again["accumulate"] == 2 and again["requested_accumulate"] == 1
    assert resumed(now, 2, 2, accumulate=4)["accumulate"] == 4


def test_an_indivisible_world_keeps_the_per_process_batch_and_the_rate_follows():
    saved = saved_config(3, 16)
    now = resumed(saved, 3, 2)
    assert now["accumulate"] == 1 and now["peak_lr"] == pytest.approx(0.025)
    line = world_change_line({"world_size": 3, "config": saved}, now, 2)
    assert line == (
        "world 3 -> 2: global batch 48 -> 32 (per-process batch 16 kept; 48 is not a multiple "
        "of 2 x 16), accumulate 1 -> 1, peak lr 0.0375 -> 0.025 (lr 0.2 per 256 images, "
        "linear scaling)"
    )
    # A new per-process batch is taken as given; the same world is no change at all.
    assert resumed(saved_config(3, 8), 3, 2)["accumulate"] == 1
    assert world_change_line({"world_size": 2, "config": saved}, now, 2) == ""


# --- One run: 3 ranks stopped inside epoch 1, resumed at 2 --------------------------------

SAMPLES, BATCH = 96, 4
SETTINGS = [
    "--cpu", "--arch", "tinycnn", "--image-size", "16", "--per-gpu-batch", str(BATCH),
    "--epochs", "1", "--timeout", "60",
]  # fmt: skip


def data_settings(data_path: str, root: Path) -> list[str]:
    """The device path on a synthetic set; the loader path on an image folder of as many."""
    if data_path == "device":
        return ["--synthetic-size", str(SAMPLES), "--data-path", "device"]
    write_noise_folder(root, per_class=SAMPLES // 3)
    return ["--dataset", "imagefolder", "--data-dir", str(root), "--data-path", "loader",
            "--workers", "0"]  # fmt: skip


@pytest.mark.parametrize("data_path", ["device", "loader"])
def test_a_run_stopped_at_3_ranks_and_resumed_at_2_trains_each_sample_once(tmp_path, data_path):
    out, trace = tmp_path / "run", tmp_path / "trace"
    env = {"DDPCLI_TRACE_SAMPLES": str(trace)}
    settings = SETTINGS + data_settings(data_path, tmp_path / "images")
    first = run_cli("train", *settings, "--nproc", "3", "--max-steps", "3", "--out", str(out),
                    env=env, timeout=240)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert safe_load(out / "checkpoints" / "last.pt")["sample_offset"] == 3 * BATCH * 3
    second = run_cli("train", *settings, "--nproc", "2", "--resume", "auto", "--out", str(out),
                     env=env, timeout=240)  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    said = second.stderr
    assert "world 3 -> 2: global batch 12 -> 8 (per-process batch 4 kept; 12 is not a " in said
    assert "epoch 1: 36 of 96 samples trained before the resume; the other 60 dealt over 2 " \
        "ranks, 7 batches of 4 each, the last of them 6 (the tail folded in)" in said  # fmt: skip
    seen = traced_counts(trace, 3, epoch=0)
    # Every sample of the epoch exactly once over both parts: the 4 that fill no global
    # batch of 8 at 2 ranks are trained in each rank's last micro-batch of 6.
    assert seen == Counter(range(SAMPLES))
    metrics = read_metrics(out)
    assert [(m["epoch"], m["world_size"], m["global_batch"]) for m in metrics] == [(1, 2, 8)]
    assert "partial" not in metrics[0]  # the whole epoch's row replaced the stopped part's
