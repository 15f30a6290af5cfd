"""The fast paths of `ddpcli train`, exercised without a GPU: the device and loader data
paths give the same batches, the DataParallel split arithmetic, --compile, precision, and
the legacy strategies refusing a machine without GPUs. GPU-only checks are marked `gpu`."""

import functools
import json

import pytest
import torch
from conftest import run_cli
from test_data import write_image_folder

from ddpcli.config import TrainConfig, build_train_config
from ddpcli.config.plan import RunPlan
from ddpcli.data.pipeline import IMAGENET_MEAN, DataPipeline
from ddpcli.data.sets import load_splits
from ddpcli.dist import DistContext
from ddpcli.errors import DdpcliError
from ddpcli.launcher.plan import plan_run
from ddpcli.training.loop import Trainer
from ddpcli.training.settle import settle_rank
from ddpcli.training.strategy import balanced_split, dataparallel_split

TINY = ["--arch", "tinycnn", "--image-size", "16", "--per-gpu-batch", "16"]


def context(rank: int = 0, world_size: int = 1, device: str = "cpu") -> DistContext:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    return DistContext(rank, rank, world_size, world_size, 0, torch.device(device), backend)


def tiny_config(tmp_path, **overrides) -> RunPlan:
    values = dict(
        arch="tinycnn", image_size=16, per_gpu_batch=8, synthetic_size=52, epochs=1, cpu=True,
        nproc=1, workers=0, out=tmp_path, seed=7,
    )  # fmt: skip
    values.update(overrides)
    return plan_run(TrainConfig(**values), None)


def pipeline(cfg: RunPlan, ctx: DistContext, device_resident: bool) -> DataPipeline:
    return DataPipeline(load_splits(cfg, ctx, device_resident), cfg, ctx, device_resident)


def rank_trainer(plan: RunPlan, ctx: DistContext) -> Trainer:
    """One CPU rank without a process group: the Trainer exactly as a worker builds it."""
    data = pipeline(plan, ctx, True)
    return Trainer(settle_rank(plan, ctx, plan.resume, data.steps_per_epoch()), ctx, data)


def collect(batches) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(images.cpu(), labels.cpu()) for images, labels in batches]


def assert_same_batches(got, want) -> None:
    assert len(got) == len(want) > 0
    for (images, labels), (want_images, want_labels) in zip(got, want, strict=True):
        assert torch.equal(labels, want_labels)
        assert torch.equal(images, want_images)  # bit for bit, not approximately


# --- The device path and the loader path give the same batches --------------------------


@pytest.mark.parametrize("workers,rank", [(0, 0), (2, 1)])
def test_device_and_loader_paths_give_identical_batches(tmp_path, workers, rank):
    # 52 images over 2 ranks in batches of 8: training drops each rank's short last batch,
    # validation keeps it.
    cfg = tiny_config(tmp_path, workers=workers)
    ctx = context(rank, world_size=2)
    device_path, loader_path = pipeline(cfg, ctx, True), pipeline(cfg, ctx, False)
    assert device_path.device_resident and not loader_path.device_resident
    for epoch in (0, 1):  # the epoch must reach workers that persist across epochs
        want = collect(device_path.train_batches(epoch))
        assert_same_batches(collect(loader_path.train_batches(epoch)), want)
    assert_same_batches(collect(loader_path.val_batches()), collect(device_path.val_batches()))
    # A resume that skips the first batch of an epoch sees the rest unchanged.
    resumed = collect(loader_path.train_batches(1, skip_batches=1))
    assert_same_batches(resumed, collect(device_path.train_batches(1))[1:])
    augmented = collect(device_path.train_batches(0))[0][0]
    assert not torch.equal(augmented, collect(device_path.train_batches(1))[0][0])


def test_loader_workers_persist_across_epochs(tmp_path):
    cfg = tiny_config(tmp_path, workers=2)
    loader_path = pipeline(cfg, context(), False)
    loader = loader_path.train_loader.loader
    assert loader.persistent_workers and loader.num_workers == 2
    collect(loader_path.train_batches(0))
    workers = [process.pid for process in loader._iterator._workers]
    collect(loader_path.train_batches(1))
    assert [process.pid for process in loader._iterator._workers] == workers


def test_image_folder_decoded_to_device_matches_the_streaming_loader(tmp_path):
    # Bit for bit with crop-flip; the random-resized crop's paths agree within interpolation
    # (tests/test_augment.py).
    write_image_folder(tmp_path / "imgs", per_class=6)
    cfg = tiny_config(
        tmp_path / "out", dataset="imagefolder", data_dir=tmp_path / "imgs", per_gpu_batch=4,
        augment="crop-flip",
    )  # fmt: skip
    ctx = context()
    device_path, loader_path = pipeline(cfg, ctx, True), pipeline(cfg, ctx, False)
    assert device_path.mean == loader_path.mean == IMAGENET_MEAN
    assert_same_batches(
        collect(loader_path.train_batches(0)), collect(device_path.train_batches(0))
    )
    assert_same_batches(collect(loader_path.val_batches()), collect(device_path.val_batches()))


# --- DataParallel's split arithmetic -------------------------------------------------------


def test_balanced_split_gives_gpu0_its_share():
    assert balanced_split(batch=8, gpus=3, gpu0_batch=2) == [2, 3, 3]
    # Accumulation 2: each micro-batch splits 2+3+3, so a step of global batch 16 is 4+6+6.
    step_shares = [share * 2 for share in balanced_split(batch=8, gpus=3, gpu0_batch=2)]
    assert step_shares == [4, 6, 6] and sum(step_shares) == 16
    assert balanced_split(9, 3, 2) == [2, 4, 3]  # the remainder goes to the first others
    assert balanced_split(16, 4, 1) == [1, 5, 5, 5]
    assert balanced_split(5, 1, 2) == [5]


def test_balanced_split_of_a_short_last_batch_never_leaves_a_gpu_empty():
    for batch in range(1, 20):
        for gpus in (2, 3, 4):
            shares = balanced_split(batch, gpus, gpu0_batch=4)
            assert sum(shares) == batch and all(share > 0 for share in shares)
    assert balanced_split(3, 3, 2) == [1, 1, 1]
    assert balanced_split(2, 3, 2) == [1, 1]


def test_dataparallel_split_is_torch_chunk():
    for batch in range(1, 20):
        for gpus in (2, 3, 4, 8):
            chunks = [len(chunk) for chunk in torch.arange(batch).chunk(gpus)]
            assert dataparallel_split(batch, gpus) == chunks


# --- Legacy strategies, precision, compile -------------------------------------------------


def resolve(**flags) -> RunPlan:
    return plan_run(build_train_config(flags, None), None)


def test_legacy_strategies_need_two_gpus(tmp_path):
    result = run_cli("train", "--cpu", "--strategy", "dp", "--out", str(tmp_path), timeout=60)
    assert result.returncode == 2
    assert "invalid --strategy" in result.stderr and "2 or more GPUs" in result.stderr
    assert "Traceback" not in result.stderr
    one_device = {"gpus": "0"} if torch.cuda.is_available() else {}  # a GPU, or the CPU
    for flags in ({"cpu": True, "strategy": "balanced-dp", "gpu0_batch": 2}, one_device):
        flags.setdefault("strategy", "dp")
        with pytest.raises(DdpcliError, match="invalid --strategy") as error:
            resolve(**flags)
        assert error.value.exit_code == 2
    with pytest.raises(DdpcliError, match="balanced-dp only"):
        resolve(cpu=True, gpu0_batch=2)


def train_in_process(cfg: RunPlan) -> tuple[Trainer, dict]:
    """One CPU rank without a process group: the Trainer exactly as a worker builds it."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    trainer = rank_trainer(cfg, context())
    return trainer, trainer.fit().last_epoch


def settled_on_a_cpu(tmp_path) -> RunPlan:
    """A rank on the CPU of a machine its launcher took for a GPU one: --precision auto is
    the rank's to settle."""
    plan = tiny_config(tmp_path).model_copy(update={"precision": "auto"})
    return settle_rank(plan, context(), None, micro_batches=3)


def test_precision_auto_on_the_cpu_asks_the_processor(monkeypatch, tmp_path):
    monkeypatch.setattr("ddpcli.training.settle.native_cpu_bf16", lambda: None)
    cfg = settled_on_a_cpu(tmp_path)
    assert cfg.precision == "fp32" and cfg.backend == "gloo"
    monkeypatch.setattr("ddpcli.training.settle.native_cpu_bf16", lambda: "AVX512_BF16")
    cfg = settled_on_a_cpu(tmp_path)
    assert cfg.precision == "bf16" and "AVX512_BF16" in cfg.precision_reason


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_each_precision_trains_on_the_cpu(tmp_path, precision):
    cfg = tiny_config(tmp_path, precision=precision, synthetic_size=32, max_steps=2)
    trainer, metrics = train_in_process(cfg)
    assert metrics["step"] == 2 and torch.isfinite(torch.tensor(metrics["train_loss"]))
    assert trainer.scaler.is_enabled() == (precision == "fp16")  # fp16 needs loss scaling
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # master weights
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert (saved["scaler"] is not None) == (precision == "fp16")
    assert metrics["peak_rss_mb"][0] > 0 and "peak_memory_mb" not in metrics
    assert metrics["first_step_at"] > 0


def test_compile_trains_a_tiny_model_on_the_cpu(tmp_path, monkeypatch):
    # Batches of 8 from 32 images: one shape, one compilation. Dynamo and AOTAutograd trace
    # the forward and backward as under inductor, without its C++ code generation (44 CPU
    # seconds here, against 3); inductor itself runs in test_compile_on_the_gpu.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    cfg = tiny_config(tmp_path, compile=True, synthetic_size=32, max_steps=3)
    trainer, metrics = train_in_process(cfg)
    assert isinstance(trainer.forward_model, torch._dynamo.eval_frame.OptimizedModule)
    assert metrics["step"] == 3 and torch.isfinite(torch.tensor(metrics["train_loss"]))
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert not any(key.startswith("_orig_mod.") for key in saved["model"])  # plain keys


def test_the_device_path_chosen_by_auto_says_that_workers_go_unused():
    from types import SimpleNamespace

    from ddpcli.data.pipeline import DevicePath

    def header_word(workers):
        return DevicePath.path_name.fget(
            SimpleNamespace(name="device", cfg=SimpleNamespace(workers=workers))
        )

    assert header_word(4) == "device (no loader: --workers 4 unused)"
    assert header_word(None) == header_word(0) == "device"


def test_loader_path_under_ddp_records_what_ran(tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train", "--cpu", *TINY, "--nproc", "2", "--synthetic-size", "256", "--epochs", "2",
        "--data-path", "loader", "--workers", "1", "--bucket-cap-mb", "1", "--out", str(out),
        timeout=150,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    # auto, resolved on the CPU: bf16 where it has native bf16, and why
    assert config["precision"] in ("fp32", "bf16") and config["precision_reason"].startswith("auto")
    assert config["data_path"] == "loader" and config["bucket_cap_mb"] == 1.0
    assert "data path loader (1 workers)" in result.stderr
    first, second = (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
    assert len(first["peak_rss_mb"]) == 2 and "first_step_at" in first
    assert "first_step_at" not in second
    assert "strategy ddp:" in result.stderr and "peak host memory (RSS) per rank" in result.stderr


# --- On a GPU machine -----------------------------------------------------------------------


@pytest.mark.gpu
def test_device_and_loader_paths_match_on_the_gpu(tmp_path):
    cfg = tiny_config(tmp_path, cpu=False, workers=2)
    ctx = context(device="cuda:0")
    device_path, loader_path = pipeline(cfg, ctx, True), pipeline(cfg, ctx, False)
    assert device_path.train_set.images.is_cuda
    assert_same_batches(
        collect(loader_path.train_batches(0)), collect(device_path.train_batches(0))
    )


@pytest.mark.gpu
def test_one_gpu_run_follows_auto_precision_and_reports_gpu_memory(tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train", "--gpus", "0", *TINY, "--synthetic-size", "512", "--epochs", "1",
        "--out", str(out), timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    # fp32 everywhere: a V100 emulates bf16, and from Ampere on a tinycnn step is launch-bound.
    ampere = torch.cuda.get_device_capability(0) >= (8, 0)
    assert config["precision"] == "fp32"
    assert ("launch-bound" in config["precision_reason"]) == ampere
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(metrics["peak_memory_mb"]) == 1 and metrics["peak_memory_mb"][0] > 0
    assert "data path device" in result.stderr and "peak GPU memory" in result.stderr


@pytest.mark.gpu
def test_compile_on_the_gpu(tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train", "--gpus", "0", *TINY, "--synthetic-size", "256", "--epochs", "1",
        "--compile", "--out", str(out), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("strategy", ["ddp", "dp", "balanced-dp"])
def test_strategies_on_two_gpus(tmp_path, strategy):
    out = tmp_path / "run"
    extra = ["--gpu0-batch", "4"] if strategy == "balanced-dp" else []
    result = run_cli(
        "train", "--gpus", "0,1", *TINY, "--synthetic-size", "512", "--epochs", "1",
        "--strategy", strategy, *extra, "--out", str(out), timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(metrics["peak_memory_mb"]) == 2
    if strategy == "balanced-dp":
        assert "split 4+12 over 2 GPUs" in result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_balanced_scatter_puts_gpu0_share_on_gpu0():
    from ddpcli.training.strategy import BalancedDataParallel

    model = BalancedDataParallel(2, torch.nn.Identity().cuda(), device_ids=[0, 1])
    pieces, kwargs = model.scatter((torch.arange(8.0, device="cuda:0"),), {}, [0, 1])
    assert [len(piece[0]) for piece in pieces] == [2, 6]
    assert [piece[0].device.index for piece in pieces] == [0, 1]
