"""The modern recipe's ingredients agree with the references they come from: torchvision's
transforms.v2 (Mixup/CutMix, random erasing, the augmentation policies), torch.optim.swa_utils
(EMA), BatchNorm over the whole global batch (SyncBN), DistributedSampler's epoch length
(repeated augmentation); and bad combinations are exit 2 naming the flag."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from collections import Counter

import pytest
import torch
from conftest import REPO, clean_env, run_bounded, run_cli
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DistributedSampler
from torchvision.transforms import v2

from ddpcli.data.augment import STREAM_AUTO_AUGMENT, STREAM_ERASE, stream_seeds
from ddpcli.data.autoaugment import auto_augment_images, policy_transform
from ddpcli.data.erasing import erase_images
from ddpcli.data.mixing import BatchMixing
from ddpcli.data.ra_sampler import repeated_shard
from ddpcli.models.build import TinyCNN
from ddpcli.training.ema import WeightAverage, adjusted_decay, slow_average_warning
from ddpcli.training.param_groups import weight_decay_groups

# --- Mixup / CutMix -------------------------------------------------------------------------


def batch(count: int = 8, side: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(count, 3, side, side, generator=generator)
    return images, torch.arange(count) % 10


@pytest.mark.parametrize(("mixup", "cutmix"), [(0.2, 0.0), (0.0, 1.0), (0.2, 1.0)])
def test_mixing_is_torchvisions_for_the_same_draws(mixup, cutmix):
    mixing = BatchMixing(mixup, cutmix, num_classes=10, seed=3)
    images, labels = batch()
    reference = [v2.MixUp(alpha=mixup, num_classes=10)] if mixup else []
    reference += [v2.CutMix(alpha=cutmix, num_classes=10)] if cutmix else []
    transform = reference[0] if len(reference) == 1 else v2.RandomChoice(reference)
    for key in range(6):
        mixed, targets = mixing(images, labels, epoch=1, batch_key=key)
        torch.manual_seed(mixing.draw_seed(1, key))
        want_images, want_targets = transform(images, labels)
        assert torch.equal(mixed, want_images) and torch.equal(targets, want_targets)
        assert torch.allclose(targets.sum(1), torch.ones(len(labels)))


def test_cutmix_targets_weigh_each_image_by_the_area_it_keeps():
    mixing = BatchMixing(0.0, 1.0, num_classes=10, seed=0)
    images, labels = batch()
    for key in range(4):
        mixed, targets = mixing(images, labels, epoch=0, batch_key=key)
        kept = (mixed[0] == images[0]).all(0).float().mean()  # image 0's own pixels
        assert targets[0, labels[0]] == pytest.approx(kept.item(), abs=1e-6)


def test_mixing_draws_are_a_pure_function_of_epoch_and_batch():
    mixing = BatchMixing(0.2, 1.0, num_classes=10, seed=0)
    images, labels = batch()
    first = mixing(images, labels, 2, 5)
    torch.rand(100)  # the global stream moves; the draw does not
    assert torch.equal(mixing(images, labels, 2, 5)[1], first[1])
    assert not torch.equal(mixing(images, labels, 3, 5)[1], first[1])


# --- Random erasing and the augmentation policies ---------------------------------------------


def test_random_erasing_is_torchvisions_for_the_same_draws():
    images, _ = batch()
    keys = torch.arange(100, 108)
    erased = erase_images(images, keys, seed=1, epoch=2, probability=0.5)
    eraser = v2.RandomErasing(p=0.5, value=0)
    for image, got, seed in zip(
        images, erased, stream_seeds(1, 2, keys, STREAM_ERASE), strict=True
    ):
        torch.manual_seed(seed)
        assert torch.equal(got, eraser(image))
    changed = [not torch.equal(a, b) for a, b in zip(images, erased, strict=True)]
    assert 0 < sum(changed) < len(changed)  # p 0.5 erases some, not all
    assert (erased[changed.index(True)] == 0).any()  # value 0: the mean after Normalize


@pytest.mark.parametrize("policy", ["ta_wide", "randaugment", "autoaugment"])
def test_policies_are_torchvisions_ops_for_the_same_draws(policy):
    generator = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (6, 3, 24, 24), dtype=torch.uint8, generator=generator)
    keys = torch.arange(6)
    transform = policy_transform(policy)
    got = auto_augment_images(images, keys, seed=0, epoch=1, transform=transform)
    for image, out, seed in zip(
        images, got, stream_seeds(0, 1, keys, STREAM_AUTO_AUGMENT), strict=True
    ):
        torch.manual_seed(seed)
        assert torch.equal(out, transform(image))
    assert got.dtype == torch.uint8 and got.shape == images.shape
    again = auto_augment_images(images, keys, seed=0, epoch=1, transform=transform)
    assert torch.equal(got, again)


# --- EMA --------------------------------------------------------------------------------------


def test_ema_decay_is_adjusted_as_torchvisions_reference_does():
    # references/classification/train.py: adjust = world x batch x ema_steps / epochs
    assert adjusted_decay(0.99998, 1024, 32, 600) == pytest.approx(1 - 2e-5 * 1024 * 32 / 600)
    assert adjusted_decay(0.9, 1024, 32, 1) == 0.0  # capped: a plain copy


def test_an_average_that_cannot_move_in_this_run_is_said():
    # The v2 recipe's schedule: 600 epochs of 1251 steps, EMA every 32: it moves; no word.
    imagenet = adjusted_decay(0.99998, 1024, 32, 600)
    assert slow_average_warning(imagenet, 32, 5 * 1251, 600 * 1251) == ""
    # Its decay on 10 epochs of 22 steps: 49 updates, the average stays at the warm-up's end.
    short = adjusted_decay(0.99998, 64, 4, 10)
    warning = slow_average_warning(short, 4, 22, 220)
    assert "makes 49 update(s)" in warning and "would still be 98%" in warning
    assert "lower --ema-decay" in warning
    assert slow_average_warning(0.9, 4, 22, 220) == ""  # 0.9^49: it has moved


def train_steps(model: nn.Module, steps: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        images = torch.randn(8, 3, 8, 8, generator=generator)
        labels = torch.randint(0, 10, (8,), generator=generator)
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        yield


def test_ema_matches_swa_utils_averaging_with_bn_buffers():
    torch.manual_seed(0)
    model = TinyCNN()
    ours = WeightAverage(model, decay=0.9, every_steps=2, warmup_steps=2)
    reference = None
    for step, _ in enumerate(train_steps(model, 8), start=1):
        ours.after_step(model, step)
        # torchvision resets the average after each update in the warm-up, so the first one
        # after it (step 4) still copies: the reference average starts there.
        if step == 4:
            reference = AveragedModel(
                model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True
            )
        if reference is not None and step % 2 == 0:
            reference.update_parameters(model)
    assert reference is not None and int(reference.n_averaged) == 3
    ema_state, want = ours.module.state_dict(), reference.module.state_dict()
    assert "features.0.1.running_mean" in ema_state
    for name, tensor in want.items():
        assert torch.allclose(ema_state[name].float(), tensor.float(), atol=1e-6), name
    raw = model.state_dict()["features.0.1.running_mean"]
    assert not torch.allclose(ema_state["features.0.1.running_mean"], raw)  # averaged, not raw


# --- Weight decay on norms --------------------------------------------------------------------


def test_norm_weight_decay_applies_to_norm_layers_only():
    model = TinyCNN()
    norm_ids = {id(p) for m in model.modules() if isinstance(m, nn.BatchNorm2d)
                for p in m.parameters()}  # fmt: skip
    groups = weight_decay_groups(model, 5e-5, 1e-6)
    by_decay = {group["weight_decay"]: {id(p) for p in group["params"]} for group in groups}
    assert by_decay[1e-6] == norm_ids
    assert by_decay[0.0] == {id(model.fc.bias)}
    assert id(model.fc.weight) in by_decay[5e-5]
    # --norm-weight-decay 0: today's two groups, so earlier checkpoints still resume
    assert [g["weight_decay"] for g in weight_decay_groups(model, 5e-5, 0.0)] == [5e-5, 0.0]


# --- SyncBN: 2 Gloo ranks against one process with the whole global batch -----------------------

SYNC_BN_RANKS = """
import os, sys, torch, torch.distributed as dist
from torch import nn
from torch.multiprocessing import start_processes
from ddpcli.training.syncbn import convert_sync_batchnorm

def rank_main(rank, out, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.manual_seed(0)
    whole = torch.randn(12, 4, 5, 5) * 3 + 1
    layer = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4)), torch.device("cpu"))
    mine = whole[rank * 4 : rank * 4 + 4 + 4 * rank].clone().requires_grad_()  # 4 and 8 rows
    output = layer(mine)
    (output * torch.arange(4.0).view(1, 4, 1, 1)).sum().backward()
    low = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4)), torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as --precision bf16 runs it
        low_output = low(mine.detach().bfloat16())
    offset = convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4)), torch.device("cpu"))
    offset_output = offset(mine.detach() * 0.01 + 1000)  # a large mean, a tiny spread
    torch.save({"output": output.detach(), "grad": mine.grad, "state": layer.state_dict(),
                "weight_grad": layer[0].weight.grad, "bf16_output": low_output.detach(),
                "bf16_state": low.state_dict(), "offset_output": offset_output.detach()},
               f"{out}/rank{rank}.pt")
    dist.destroy_process_group()

if __name__ == "__main__":
    start_processes(rank_main, args=(sys.argv[1], int(sys.argv[2])), nprocs=2,
                    start_method="fork")
"""


def test_sync_bn_statistics_are_those_of_the_whole_global_batch(tmp_path):
    from conftest import free_port

    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(SYNC_BN_RANKS))
    command = [sys.executable, str(script), str(tmp_path), str(free_port())]
    result = run_bounded(command, 120, clean_env(PYTHONPATH=str(REPO)))
    assert result.returncode == 0, result.stderr[-2000:]
    torch.manual_seed(0)
    whole = (torch.randn(12, 4, 5, 5) * 3 + 1).requires_grad_()
    layer = nn.BatchNorm2d(4)
    output = layer(whole)
    (output * torch.arange(4.0).view(1, 4, 1, 1)).sum().backward()
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    rows = [slice(0, 4), slice(4, 12)]  # unequal shares: the counts weigh the statistics
    for rank, got in enumerate(ranks):
        assert torch.allclose(got["output"], output[rows[rank]].detach(), atol=1e-5)
        assert torch.allclose(got["grad"], whole.grad[rows[rank]], atol=1e-5)
        for name in ("0.running_mean", "0.running_var"):
            want = layer.state_dict()[name.removeprefix("0.")]
            assert torch.allclose(got["state"][name], want, atol=1e-6), name
    summed = ranks[0]["weight_grad"] + ranks[1]["weight_grad"]  # what DDP's all-reduce adds
    assert torch.allclose(summed, layer.weight.grad, atol=1e-4)
    # Under bf16 autocast: bf16 out, float32 statistics, torch's BatchNorm's figures.
    low = nn.BatchNorm2d(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low_output = low(whole.detach().bfloat16())
    for rank, got in enumerate(ranks):
        assert got["bf16_output"].dtype == low_output.dtype == torch.bfloat16
        assert torch.allclose(got["bf16_output"].float(), low_output[rows[rank]].float(), atol=0.05)
        for name in ("0.running_mean", "0.running_var"):
            stats = got["bf16_state"][name]
            assert stats.dtype == torch.float32
            assert torch.allclose(stats, low.state_dict()[name.removeprefix("0.")], rtol=1e-2)
    # Mean 1000, spread 0.03: E[x^2] - E[x]^2 would lose every digit in float32.
    offset = nn.BatchNorm2d(4)(whole.detach() * 0.01 + 1000)
    for rank, got in enumerate(ranks):
        assert torch.allclose(got["offset_output"], offset[rows[rank]].detach(), atol=2e-3)


# --- Repeated augmentation ----------------------------------------------------------------------


@pytest.mark.parametrize(("size", "world", "reps"), [(100, 4, 4), (101, 4, 3), (64, 2, 2)])
def test_repeated_augmentation_epoch_is_distributed_samplers_length(size, world, reps):
    shards = [
        repeated_shard(size, world, rank, seed=0, epoch=1, reps=reps) for rank in range(world)
    ]
    reference = DistributedSampler(range(size), num_replicas=world, rank=0)  # type: ignore[arg-type]
    assert {len(shard) for shard in shards} == {len(reference)} == {math.ceil(size / world)}
    ranks_of = Counter()
    for shard in shards:
        for image in {key % size for key in shard}:
            ranks_of[image] += 1
    full = [count for count in ranks_of.values()]
    assert max(full) == reps and Counter(full)[reps] >= len(full) - 2 * world  # edges cut
    for shard in shards:  # a copy's key names its image and a draw of its own
        assert len(set(shard)) == len(shard)
    assert repeated_shard(size, world, 0, 0, 2, reps) != shards[0]  # a new order each epoch


# --- Flags: validation and what a dry run shows -------------------------------------------------


def dry_run(*flags: str):
    return run_cli("train", "--cpu", "--dry-run", "--json", *flags, timeout=60)


def test_dry_run_resolves_and_shows_every_recipe_setting():
    result = dry_run("--dataset", "synthetic", "--augment", "rrc", "--train-crop-size", "24")
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert config["train_crop_size"] == 24
    assert (config["val_resize_size"], config["val_crop_size"]) == (32, 32)
    defaults = {
        "sync_bn": False, "ema": False, "ema_decay": 0.99998, "ema_steps": 32,
        "mixup_alpha": 0.0, "cutmix_alpha": 0.0, "auto_augment": "none", "random_erase": 0.0,
        "ra_reps": 1, "norm_weight_decay": 0.0,
    }  # fmt: skip
    for name, value in defaults.items():
        assert config[name] == value, name


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("--ra-reps", "3"), "invalid --ra-reps: 3 copies"),
        (("--train-crop-size", "24"), "invalid --train-crop-size: it is the side of --augment rrc"),
        (
            ("--val-resize-size", "36", "--val-crop-size", "40"),
            "invalid --val-crop-size: 40 is larger than --val-resize-size 36",
        ),
        (("--random-erase", "1.5"), "--random-erase"),
        (("--strategy", "dp", "--sync-bn"), "invalid --sync-bn: it synchronises DDP ranks"),
        (("--auto-augment", "cutout"), "--auto-augment"),
        (("--ema-decay", "1"), "--ema-decay"),
    ],
)
def test_bad_recipe_flags_exit_2_naming_the_flag(flags, said):
    result = dry_run("--nproc", "2", *flags)
    assert result.returncode == 2
    assert said in result.stderr and "Traceback" not in result.stderr


def test_v2_recipe_dry_run_shows_every_setting(tmp_path):
    from PIL import Image

    for split, names in (("train", ("a", "b")), ("val", ("a",))):
        for name in names:
            (tmp_path / split / name).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(tmp_path / split / name / "0.png")
    recipe = REPO / "recipes" / "imagenet-resnet50-v2.toml"
    args = ("--recipe", str(recipe), "--data-dir", str(tmp_path), "--nproc", "8")
    result = run_cli("train", "--cpu", "--dry-run", *args, timeout=60)
    assert result.returncode == 0, result.stderr
    shown = dict(line.split(" = ", 1) for line in result.stdout.splitlines())
    want = {
        "arch": "resnet50", "train_crop_size": "176", "val_resize_size": "232",
        "val_crop_size": "224", "auto_augment": "ta_wide", "random_erase": "0.1",
        "mixup_alpha": "0.2", "cutmix_alpha": "1.0", "label_smoothing": "0.1", "ra_reps": "4",
        "epochs": "600", "weight_decay": "2e-05", "norm_weight_decay": "0.0", "ema": "True",
        "ema_steps": "32", "ema_decay": "0.99998", "global_batch": "1024", "peak_lr": "0.5",
    }  # fmt: skip
    assert {key: shown.get(key) for key in want} == want
    # With fewer processes than copies of each image, it says so before anything starts.
    few = run_cli("train", "--cpu", "--dry-run", *args[:-1], "2", timeout=60)
    assert few.returncode == 2 and "invalid --ra-reps: 4 copies" in few.stderr
    # The device path caches image folders at the default validation view: it names the path
    # that takes the recipe's 232 -> 224.
    device = run_cli("train", "--cpu", "--dry-run", *args, "--data-path", "device", timeout=60)
    assert device.returncode == 2 and "use --data-path loader" in device.stderr
