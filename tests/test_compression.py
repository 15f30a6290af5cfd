"""--grad-compression: replicas bit-identical under every compression on a real 2-rank Gloo
group with many buckets, PowerSGD's per-rank state in the checkpoint and an exact resume,
the bytes in the header, and the pairings refused with exit 2."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port, read_metrics, run_cli

from ddpcli.checkpoint.loading import safe_load
from ddpcli.config import TrainConfig
from ddpcli.config.train import build_train_config
from ddpcli.errors import DdpcliError

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd:1")
STEPS = 4


# --- replicas: every compression, 2 Gloo ranks, one parameter per bucket -------------------


def parameter_hash(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for parameter in module.parameters():
        digest.update(parameter.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def replica_worker(rank: int, port: int, out: str) -> None:
    """Each compression on a fresh DDP built as the trainer builds it (wrap_model), each
    rank on its own data: every step's parameter hash, and PowerSGD's gradient ranks."""
    import torch.distributed as dist

    from ddpcli.dist import DistContext
    from ddpcli.models.build import build_model
    from ddpcli.training.strategy import wrap_model

    torch.set_num_threads(1)  # two ranks on a CI runner's two cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ctx = DistContext(rank, rank, 2, 2, 0, torch.device("cpu"), "gloo")
    report: dict[str, dict] = {}
    for compression in COMPRESSIONS:
        torch.manual_seed(0)
        cfg = TrainConfig(
            cpu=True, arch="tinycnn", grad_compression=compression, powersgd_start_step=1,
            bucket_cap_mb=0.002,
        )  # fmt: skip
        model = wrap_model(build_model("tinycnn", 10, {}), cfg, ctx)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        data = torch.Generator().manual_seed(100 + rank)
        hashes, grad_ranks = [], []
        for _ in range(STEPS):
            images = torch.randn(8, 3, 16, 16, generator=data)
            labels = torch.randint(0, 10, (8,), generator=data)
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            weight = model.module.features[2][0].weight.grad  # 16 x 8 x 3 x 3: compressed
            grad_ranks.append(int(torch.linalg.matrix_rank(weight.reshape(16, -1))))
            optimizer.step()
            optimizer.zero_grad()
            hashes.append(parameter_hash(model))
        report[compression] = {"hashes": hashes, "grad_ranks": grad_ranks}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def spawn_ranks(worker, out: Path, nprocs: int = 2, method: str = "spawn", timeout: float = 150):
    """WORKER(rank, port, out) on NPROCS processes; each rank's JSON report, in rank order.
    Spawned, not forked: a test run earlier in the same pytest worker may have started
    autograd's threads, and a forked child then refuses to run backward."""
    import torch.multiprocessing as mp

    context = mp.start_processes(
        worker, args=(free_port(), str(out)), nprocs=nprocs, join=False, start_method=method
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{nprocs} ranks still running after {timeout}s: a hang")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nprocs)]


def test_every_compression_keeps_the_replicas_bit_identical_after_every_step(tmp_path):
    rank0, rank1 = spawn_ranks(replica_worker, tmp_path)
    for compression in COMPRESSIONS:
        hashes = rank0[compression]["hashes"]
        assert hashes == rank1[compression]["hashes"], compression
        assert len(set(hashes)) == STEPS, f"{compression}: the weights did not move"
    # Compressed steps differ from the uncompressed ones, and PowerSGD's gradients have its
    # rank from --powersgd-start-step on (step 1 is all-reduced as is).
    final = {compression: rank0[compression]["hashes"][-1] for compression in COMPRESSIONS}
    assert len(set(final.values())) == len(COMPRESSIONS)
    grad_ranks = rank0["powersgd:1"]["grad_ranks"]
    assert grad_ranks[0] > 1 and grad_ranks[1:] == [1] * (STEPS - 1)


def owner_worker(rank: int, port: int, out: str) -> None:
    """The strategy's ParallelModel holds the hook's state the checkpoint saves: PowerSGD's
    (the one the hook steps), none for the stateless hooks and for no DDP at all."""
    import torch.distributed as dist

    from ddpcli.dist import DistContext
    from ddpcli.models.build import build_model
    from ddpcli.training.compression import PowerSGD
    from ddpcli.training.strategy import parallelize

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    cfg = TrainConfig(cpu=True, arch="tinycnn", grad_compression="powersgd:1")
    ctx = DistContext(rank, rank, 1, 1, 0, cpu, "gloo")
    alone = parallelize(build_model("tinycnn", 10, {}), cfg, ctx)  # no group: no DDP
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    report: dict[str, object] = {"alone": alone.compression is None}
    for compression in COMPRESSIONS:
        cfg = TrainConfig(cpu=True, arch="tinycnn", grad_compression=compression)
        parallel = parallelize(build_model("tinycnn", 10, {}), cfg, ctx)
        for _ in range(2):
            parallel.model(torch.randn(4, 3, 16, 16)).square().mean().backward()
        state = parallel.compression
        report[compression] = state.step if isinstance(state, PowerSGD) else None
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def test_the_wrapped_models_owner_holds_the_powersgd_state_its_hook_steps(tmp_path):
    (report,) = spawn_ranks(owner_worker, tmp_path, nprocs=1)
    assert report == {"alone": True, "none": None, "fp16": None, "bf16": None, "powersgd:1": 2}


# --- the header, the checkpoint and an exact resume, with the pairings ---------------------

SETTINGS = [
    "--cpu", "--nproc", "2", "--arch", "tinycnn", "--image-size", "16", "--synthetic-size",
    "128", "--per-gpu-batch", "8", "--epochs", "2", "--accumulate", "2", "--sync-bn", "--ema",
    "--ema-steps", "1", "--precision", "bf16", "--grad-compression", "powersgd:1",
    "--powersgd-start-step", "2", "--bucket-cap-mb", "0.005", "--save-every-steps", "3",
    "--keep-last", "20",
]  # fmt: skip
COMPARED = ("train_loss", "train_acc", "val_loss", "val_acc", "ema_val_loss", "lr")


def train(out: Path, *extra: str):
    result = run_cli("train", *SETTINGS, "--out", str(out), *extra, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_powersgd_checkpoints_each_ranks_state_and_resumes_exactly(tmp_path):
    reference = tmp_path / "reference"
    result = train(reference)
    assert "gradients: powersgd rank 1 after 2 uncompressed steps: about 1.9 kB all-reduced" in (
        result.stderr
    )
    saved = safe_load(reference / "checkpoints" / "step-00000003.pt", check_digest=True)
    state = saved["grad_compression"]
    assert (state["method"], state["world_size"], len(state["ranks"])) == ("powersgd:1", 2, 2)
    assert [own["step"] for own in state["ranks"]] == [3, 3]
    errors = [own["errors"] for own in state["ranks"]]
    assert errors[0].keys() == errors[1].keys() and errors[0]
    assert any(not torch.equal(errors[0][key], errors[1][key]) for key in errors[0])  # per rank
    # Killed after step 3 (mid-epoch 1, accumulating, sync-bn, EMA, bf16): resumed, the
    # same numbers as the run that went on.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(reference / "checkpoints" / "step-00000003.pt", resumed / "checkpoints" / "last.pt")
    result = train(resumed, "--resume", "auto")
    assert "start afresh" not in result.stderr and "settings differ" not in result.stderr
    got, want = read_metrics(resumed), read_metrics(reference)
    assert [row["epoch"] for row in got if not row.get("partial")] == [1, 2]
    for got_row, want_row in zip(got, want, strict=True):
        for key in COMPARED:
            assert got_row[key] == pytest.approx(want_row[key], rel=1e-6, abs=1e-12), key


def test_a_resume_at_another_world_starts_powersgd_afresh_and_says_so():
    from ddpcli.dist import DistContext
    from ddpcli.training.compression import PowerSGD

    saving = PowerSGD(rank=2, start_step=0, seed=0, keys={}, step=7)
    saving.errors[3] = torch.ones(4, 5)
    cpu = torch.device("cpu")
    alone = DistContext(0, 0, 1, 1, 0, cpu, "gloo")
    saved = saving.checkpoint_state(alone)
    assert saved is not None and saved["ranks"][0]["step"] == 7
    same = PowerSGD(rank=2, start_step=0, seed=0, keys={})
    assert same.resume(saved, 7, alone) is None
    assert same.step == 7 and torch.equal(same.errors[3], torch.ones(4, 5))
    bigger = PowerSGD(rank=2, start_step=0, seed=0, keys={})
    line = bigger.resume(saved, 7, DistContext(0, 0, 3, 3, 0, cpu, "gloo"))
    assert line is not None and "world changed from 1 to 3" in line and "start afresh" in line
    assert bigger.errors == {} and bigger.step == 7
    other_rank = PowerSGD(rank=4, start_step=0, seed=0, keys={})
    assert "powersgd:2" in (other_rank.resume(saved, 7, alone) or "")


# --- settings ------------------------------------------------------------------------------


def test_bytes_per_step_follow_the_parameter_shapes():
    from ddpcli.models.build import build_model
    from ddpcli.training.compression import bytes_per_step

    with torch.device("meta"):  # shapes only
        parameters = list(build_model("resnet18", 10, {}).parameters())
    assert bytes_per_step(parameters, "none") == 44_726_568  # 11,181,642 fp32 gradients
    assert bytes_per_step(parameters, "bf16") == 44_726_568 // 2
    assert 0.3e6 < bytes_per_step(parameters, "powersgd:2") < 0.35e6


@pytest.mark.parametrize(
    "flags, words",
    [
        ({"grad_compression": "powersgd", "precision": "fp16"}, "loss scale"),
        ({"grad_compression": "fp16", "strategy": "dp"}, "--strategy dp is one process"),
        ({"grad_compression": "powersgd:0"}, "rank is a whole number"),
        ({"grad_compression": "topk"}, "use none, fp16, bf16, powersgd"),
        ({"static_graph": True, "accumulate": 2}, "fails an internal assertion"),
        ({"compile": True, "bucket_cap_mb": 0.5}, "at least 1 MB"),
    ],
)
def test_pairings_that_cannot_be_correct_are_refused(flags, words):
    with pytest.raises(DdpcliError) as refused:
        build_train_config(flags, None, environ={})
    assert refused.value.exit_code == 2 and words in str(refused.value)


def test_powersgd_alone_means_rank_4_and_the_recipe_sets_it(tmp_path):
    # Rank 4: the lowest that kept the digits' accuracy (docs/performance.md, issue 37).
    assert build_train_config({"grad_compression": "powersgd"}, None, {}).grad_compression == (
        "powersgd:4"
    )
    recipe = tmp_path / "slow-link.toml"
    recipe.write_text(
        'grad-compression = "powersgd:1"\npowersgd-start-step = 10\nstatic-graph = true\n'
        "gradient-as-bucket-view = false\n"
    )
    cfg = build_train_config({}, recipe, {})
    assert (cfg.grad_compression, cfg.powersgd_start_step) == ("powersgd:1", 10)
    assert (cfg.static_graph, cfg.gradient_as_bucket_view) == (True, False)
    defaults = TrainConfig()
    assert (defaults.static_graph, defaults.gradient_as_bucket_view) == (False, True)
    assert (defaults.grad_compression, defaults.powersgd_start_step) == ("none", 1000)


def test_powersgd_with_fp16_exits_2_with_the_reason(in_process):
    result = in_process("train", "--cpu", "--grad-compression", "powersgd", "--precision", "fp16")
    assert result.returncode == 2
    assert "--precision bf16 or fp32" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.gpu
def test_every_compression_trains_on_two_gpus_with_nccl(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    for compression in COMPRESSIONS:
        out = tmp_path / compression.replace(":", "-")
        start = ["--powersgd-start-step", "2"] if compression.startswith("powersgd") else []
        result = run_cli(
            "train", "--gpus", "0,1", "--arch", "resnet18", "--image-size", "32",
            "--synthetic-size", "512", "--epochs", "1", "--per-gpu-batch", "32",
            "--grad-compression", compression, *start, "--out", str(out), timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert "gradients: " in result.stderr


def gpu_powersgd_worker(rank: int, port: int, out: str) -> None:
    """PowerSGD on NCCL, one rank on cuda:0, channels_last weights as the trainer lays them
    out: the hook's future hands DDP the reduced gradients on the GPU's stream."""
    import torch.distributed as dist

    from ddpcli.dist import DistContext
    from ddpcli.models.build import build_model
    from ddpcli.training.strategy import wrap_model

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ctx = DistContext(0, 0, 1, 1, 0, device, "nccl")
    cfg = TrainConfig(arch="resnet18", grad_compression="powersgd:1", powersgd_start_step=1)
    torch.manual_seed(0)
    model = build_model("resnet18", 10, {}).to(device, memory_format=torch.channels_last)
    model = wrap_model(model, cfg, ctx)
    ranks = []
    for _ in range(3):
        images = torch.randn(8, 3, 32, 32, device=device).contiguous(
            memory_format=torch.channels_last
        )
        model(images).square().mean().backward()
        weight = model.module.layer1[0].conv1.weight.grad
        assert weight is not None and bool(weight.isfinite().all())
        ranks.append(int(torch.linalg.matrix_rank(weight.reshape(64, -1).float())))
        model.zero_grad()
    Path(out, "rank0.json").write_text(json.dumps({"grad_ranks": ranks}))
    dist.destroy_process_group()


@pytest.mark.gpu
def test_powersgd_on_nccl_reduces_channels_last_gradients(tmp_path):
    (report,) = spawn_ranks(gpu_powersgd_worker, tmp_path, nprocs=1, method="spawn")
    assert report["grad_ranks"][0] > 1 and report["grad_ranks"][1:] == [1, 1]
