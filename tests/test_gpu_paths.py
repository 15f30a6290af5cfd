"""The CUDA paths checked on the CPU where a stand-in can show the defect: no per-batch copy
from the host on the device data path (the `meta` device stands in for a GPU), no host copy
of a set kept on the device, DataParallel replicas in the configured precision and layout.
Where only a GPU can show it, the test is marked `gpu`."""

import gc
import json
import os
import re
import sys
import threading
import weakref

import pytest
import torch
from conftest import clean_env, run_cli
from torch import nn

from ddpcli import dist as dist_module
from ddpcli.config import TrainConfig
from ddpcli.data import device, pipeline, sets
from ddpcli.dist import DistContext
from ddpcli.environments import LauncherEnv
from ddpcli.errors import DdpcliError
from ddpcli.launcher import resolve
from ddpcli.launcher.plan import plan_run
from ddpcli.training import header, parts, strategy, worker

META = torch.device("meta")  # a device that is not the host: every copy to it is visible


def tiny_set(count: int = 20, side: int = 12) -> sets.ImageSet:
    images = torch.randint(0, 256, (count, 3, side, side), dtype=torch.uint8)
    return sets.ImageSet(images, torch.arange(count) % 3)


@pytest.fixture
def host_copies(monkeypatch):
    """Every `.to` that moves a tensor from the host to another device, as it happens."""
    copies: list[tuple[int, ...]] = []
    real_to = torch.Tensor.to

    def spying_to(self, *args, **kwargs):
        moved = real_to(self, *args, **kwargs)
        if self.device.type == "cpu" and moved.device.type != "cpu":
            copies.append(tuple(self.shape))
        return moved

    monkeypatch.setattr(torch.Tensor, "to", spying_to)
    return copies


@pytest.mark.parametrize("augment", ["crop-flip", "rrc", "none"])
def test_device_batches_copy_nothing_from_the_host_per_batch(host_copies, augment):
    batches = device.DeviceResidentBatches(
        tiny_set(), list(range(20)), 4, META, [0.5] * 3, [0.2] * 3, augment, 1, 0,
        image_size=8,
    )  # fmt: skip
    copied_per_epoch = len(host_copies)
    shapes = [(tuple(images.shape), tuple(labels.shape)) for images, labels in batches]
    assert (
        shapes == [((4, 3, 8 if augment == "rrc" else 12, 8 if augment == "rrc" else 12), (4,))] * 5
    )
    assert host_copies[copied_per_epoch:] == []  # a blocking copy per batch waits for the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("augment", ["crop-flip", "rrc", "none"])
def test_device_batches_never_synchronise_the_gpu(augment):
    batches = device.DeviceResidentBatches(
        tiny_set(64, 16), list(range(64)), 16, torch.device("cuda"), [0.5] * 3, [0.2] * 3,
        augment, 1, 0, channels_last=True, drop_last=True, image_size=16,
    )  # fmt: skip
    torch.cuda.set_sync_debug_mode("error")
    try:
        for images, labels in batches:
            images.sum(), labels.sum()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_set_kept_on_the_device_leaves_no_host_copy(tmp_path):
    splits = sets.synthetic_splits(40, 8, seed=1)
    host_images = weakref.ref(splits.train.images)
    request = TrainConfig(arch="tinycnn", image_size=8, per_gpu_batch=4, out=tmp_path, cpu=True)
    cfg = plan_run(request, None)
    ctx = DistContext(0, 0, 1, 1, 0, META, "gloo")
    data = pipeline.DataPipeline(splits, cfg, ctx, device_resident=True)
    gc.collect()
    assert host_images() is None  # the whole set held twice, per rank, otherwise
    assert {data.train_set.images.device, data.train_set.labels.device} == {META}
    assert data.splits.val.images.device == META


# --- DataParallel: precision and layout of the replicas -------------------------------------


class DtypeProbe(nn.Module):
    """Records the dtype its matmul ran in, on the thread that ran it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.seen.append(out.dtype)
        return out


def threaded_apply(modules, inputs, kwargs_tup=None, devices=None):
    """torch's parallel_apply on the CPU: each replica in its own thread, autocast enabled
    there without a dtype, exactly as torch 2.14's worker threads do it."""
    enabled = torch.is_autocast_enabled("cpu")
    results: list[torch.Tensor | None] = [None] * len(modules)

    def work(position: int) -> None:
        with torch.autocast("cpu", enabled=enabled):
            results[position] = modules[position](*inputs[position])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(modules))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_dataparallel_replicas_run_in_the_configured_precision(monkeypatch):
    # A new thread's autocast dtype is the device's default (bf16 on the CPU, fp16 on CUDA),
    # whatever the caller's autocast says: ask for the other one.
    data_parallel_module = sys.modules["torch.nn.parallel.data_parallel"]
    monkeypatch.setattr(data_parallel_module, "parallel_apply", threaded_apply)
    probes = [DtypeProbe(), DtypeProbe()]
    parallel = strategy.PrecisionDataParallel(
        DtypeProbe(), device_ids=None, autocast=("cpu", torch.float16)
    )
    with torch.autocast("cpu", dtype=torch.float16):
        parallel.parallel_apply(probes, [(torch.ones(2, 4),)] * 2, None)
    assert [probe.seen for probe in probes] == [[torch.float16], [torch.float16]]


def test_dataparallel_replicas_keep_channels_last(monkeypatch):
    def broadcast_as_torch_does(tensors, devices, detach=False):
        # comm.broadcast_coalesced flattens the tensors: every copy comes back contiguous.
        return [[t.detach().clone().contiguous() for t in tensors] for _ in devices]

    replicate_module = sys.modules["torch.nn.parallel.replicate"]
    monkeypatch.setattr(replicate_module, "_broadcast_coalesced_reshape", broadcast_as_torch_does)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 1))
    model = model.to(memory_format=torch.channels_last)
    parallel = strategy.PrecisionDataParallel(model, device_ids=None, channels_last=True)
    for replica in parallel.replicate(model, [0, 1]):
        weights = [replica[0].weight, replica[2].weight]
        assert all(w.is_contiguous(memory_format=torch.channels_last) for w in weights)
        assert torch.equal(replica[0].weight, model[0].weight)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_dataparallel_on_two_gpus_runs_bf16_in_every_replica():
    probe = DtypeProbe().cuda()
    parallel = strategy.PrecisionDataParallel(
        probe, device_ids=[0, 1], autocast=("cuda", torch.bfloat16), channels_last=True
    )
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = parallel(torch.ones(8, 4, device="cuda"))
    assert out.dtype == torch.bfloat16


# --- A failed rank ends at once --------------------------------------------------------------


def test_a_failed_rank_does_not_tear_down_its_group(monkeypatch, tmp_path):
    """destroy_process_group after a CUDA OOM mid-backward can wait for the other ranks'
    watchdogs (--timeout) before anyone hears of the failure: the worker must not call it."""
    ctx = DistContext(1, 1, 2, 2, 0, torch.device("cpu"), "gloo")

    def out_of_memory(cfg, ctx, resume):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def teardown_that_hangs():
        raise AssertionError("destroy_process_group called after a failure: it can hang")

    monkeypatch.setattr(worker, "init_distributed", lambda env, **kwargs: ctx)
    monkeypatch.setattr(worker, "train_and_summarise", out_of_memory)
    monkeypatch.setattr(worker, "shutdown", teardown_that_hangs)
    env = LauncherEnv(rank=1, local_rank=1, world_size=2, local_world_size=2)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        worker.run_worker(plan_run(TrainConfig(cpu=True, out=tmp_path), None), env)


def test_a_failed_rank_under_torchrun_says_which_rank_in_one_line(tmp_path):
    """Adopted by an outside launcher, with a live group (file:// init), a rank that fails
    mid-epoch (here: its sample trace cannot be written) names itself and exits 1."""
    out = tmp_path / "run"
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               DDPCLI_TRACE_SAMPLES=str(tmp_path / "missing" / "trace"))  # fmt: skip
    result = run_cli(
        "train", "--cpu", "--arch", "tinycnn", "--image-size", "16", "--epochs", "1",
        "--per-gpu-batch", "16", "--timeout", "60", "--out", str(out),
        "--init-method", f"file://{tmp_path / 'init'}", env=env, timeout=90,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert "rank 0: FileNotFoundError" in result.stderr
    assert "Traceback" not in result.stderr and "Abort" not in result.stderr


# --- TF32 under --precision fp32 on CUDA -----------------------------------------------------


@pytest.fixture
def restore_float32_math():
    matmul, conv = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    benchmark = torch.backends.cudnn.benchmark
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = conv, benchmark


def test_fp32_on_cuda_uses_tf32_and_says_so(restore_float32_math, gpu_of_capability):
    gpu_of_capability((8, 0))
    torch.set_float32_matmul_precision("highest")  # torch's default: IEEE fp32 matmuls
    parts.configure_cuda_math("fp32", torch.device("cuda", 0))  # sets flags only: no GPU needed
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cudnn.allow_tf32
    text = header.describe_precision("fp32", torch.device("cuda", 0))
    assert text == "fp32 (TF32 tensor cores in matmuls and convolutions)"


@pytest.mark.parametrize("precision,device_type", [("bf16", "cuda"), ("fp32", "cpu")])
def test_tf32_only_where_fp32_runs_on_cuda(restore_float32_math, precision, device_type):
    torch.set_float32_matmul_precision("highest")
    parts.configure_cuda_math(precision, torch.device(device_type))
    assert torch.get_float32_matmul_precision() == "highest"
    assert header.describe_precision(precision, torch.device(device_type)) == precision


@pytest.mark.gpu
def test_an_fp32_run_on_the_gpu_states_tf32_in_its_header(tmp_path):
    result = run_cli(
        "train", "--gpus", "0", "--arch", "tinycnn", "--image-size", "16", "--epochs", "1",
        "--per-gpu-batch", "16", "--precision", "fp32", "--out", str(tmp_path / "run"),
        timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    stated = "precision fp32 (TF32 tensor cores in matmuls and convolutions)" in result.stderr
    assert stated is ampere_or_later()  # a V100 or T4 has no TF32


# --- Rank 0 prepares the data while the others wait on the store -----------------------------

PREPARE_RANK = """
import datetime, sys, time
import torch, torch.distributed as dist
from ddpcli.dist import DistContext, rank_zero_prepares
from ddpcli.errors import DdpcliError
rank, init, wait_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
# The group's own timeout (--timeout) is far shorter than rank 0's preparation.
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=2))
ctx = DistContext(rank, rank, 2, 2, 0, torch.device("cpu"), "gloo")
try:
    with rank_zero_prepares(ctx, "download STL-10", timeout_s=wait_s):
        if rank == 0:
            time.sleep(5)
except DdpcliError as error:
    print(error.message, file=sys.stderr)
    sys.exit(error.exit_code)
dist.destroy_process_group()
"""


def prepare_in_two_ranks(tmp_path, wait_s: float):
    from test_faults import run_together

    init = f"file://{tmp_path / 'init'}"
    commands = [
        ([sys.executable, "-c", PREPARE_RANK, str(rank), init, str(wait_s)], clean_env())
        for rank in (0, 1)
    ]
    return run_together(commands, timeout=60)


def test_the_others_wait_for_rank_zero_beyond_the_group_timeout(tmp_path):
    """A download longer than --timeout no longer kills the job (an NCCL barrier did)."""
    rank0, rank1 = prepare_in_two_ranks(tmp_path, wait_s=30)
    assert (rank0.returncode, rank1.returncode) == (0, 0), rank1.stderr[-1500:]
    assert "rank 1 waits for rank 0 to download STL-10" in rank1.stderr


def test_a_preparation_that_never_ends_is_named_by_the_waiting_rank(tmp_path):
    _, rank1 = prepare_in_two_ranks(tmp_path, wait_s=1)
    assert rank1.returncode == 1
    assert "rank 1: rank 0 did not download STL-10 within 1s" in rank1.stderr


# --- --precision auto and the TF32 note: Ampere (compute capability 8.0) or later ------------


@pytest.fixture
def gpu_of_capability(monkeypatch):
    """A GPU of the given compute capability, as torch.cuda reports it. is_bf16_supported()
    says True whatever it is: by default it counts emulation (a V100 or T4 says True)."""

    def make(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return make


@pytest.mark.parametrize(
    ("capability", "precision"),
    [((7, 0), "fp32"), ((7, 5), "fp32"), ((8, 0), "bf16"), ((8, 6), "bf16"), ((9, 0), "bf16")],
)
def test_auto_precision_is_bf16_only_from_compute_capability_8(
    tmp_path, monkeypatch, gpu_of_capability, capability, precision
):
    """cuDNN runs bf16 convolutions only from 8.0: on a V100 (7.0) or T4 (7.5) they take a
    slow path, so `auto` keeps fp32 there and says why. For a compute-bound step (resnet50's
    at 224 px, batch 64): the launch-bound ones are tests/test_compile_mode.py's."""
    gpu_of_capability(capability)
    monkeypatch.setattr("ddpcli.training.settle.training_gflop_per_step", lambda *args: 1569.5)
    from test_speed_paths import tiny_config

    from ddpcli.training.settle import settle_rank

    cfg = tiny_config(tmp_path, lr=0.1).model_copy(update={"precision": "auto", "cpu": False})
    ctx = DistContext(0, 0, 1, 1, 0, torch.device("cuda", 0), "nccl")
    resolved = settle_rank(cfg, ctx, None, micro_batches=1)
    assert resolved.precision == precision
    assert f"compute capability {capability[0]}.{capability[1]}" in resolved.precision_reason


@pytest.mark.parametrize(("capability", "note"), [((7, 0), False), ((7, 5), False), ((8, 0), True)])
def test_the_tf32_note_is_only_for_gpus_with_tf32(gpu_of_capability, capability, note):
    gpu_of_capability(capability)
    text = header.describe_precision("fp32", torch.device("cuda", 0))
    assert ("TF32 tensor cores" in text) is note
    assert text == ("fp32 (TF32 tensor cores in matmuls and convolutions)" if note else "fp32")


def ampere_or_later() -> bool:
    return torch.cuda.get_device_capability(0) >= (8, 0)


@pytest.mark.gpu
def test_auto_precision_on_this_gpu_follows_its_compute_capability(tmp_path):
    """The same decision as the CPU test above, from the real device: not from
    is_bf16_supported(), which says True on a V100 as well. A tinycnn step is launch-bound:
    fp32 from 8.0 too, for that reason."""
    out = tmp_path / "run"
    result = run_cli(
        "train", "--gpus", "0", "--arch", "tinycnn", "--image-size", "16", "--epochs", "1",
        "--per-gpu-batch", "16", "--out", str(out), timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    assert config["precision"] == "fp32"
    assert ("launch-bound" in config["precision_reason"]) == ampere_or_later()
    major, minor = torch.cuda.get_device_capability(0)
    assert f"compute capability {major}.{minor}" in config["precision_reason"]


# --- A CUDA build of torch that cannot use the node's GPUs: exit 2, not a silent CPU run ------

FAKE_NVIDIA_SMI = """#!/bin/sh
# nvidia-smi on a node of {count} A100s whose driver is {driver}
case "$*" in
  *driver_version*) for i in $(seq 0 {last}); do echo "{driver}"; done ;;
  *index,name*) for i in $(seq 0 {last}); do echo "$i, NVIDIA A100, 81920, GPU-$i"; done ;;
  -L) for i in $(seq 0 {last}); do echo "GPU $i: NVIDIA A100 (UUID: GPU-$i)"; done ;;
  *) exit 1 ;;
esac
"""


def node_with_gpus_torch_cannot_use(tmp_path, count: int = 8, driver: str = "535.104.05"):
    """The variables of a shell whose nvidia-smi lists COUNT GPUs (this machine's torch, a
    CUDA build, sees none: torch.cuda.is_available() is False here)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "nvidia-smi"
    script.write_text(FAKE_NVIDIA_SMI.format(count=count, last=count - 1, driver=driver))
    script.chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}"}


@pytest.fixture
def on_that_node(tmp_path, monkeypatch, in_process):
    """`ddpcli ARGS` in this process (in_process) on such a node: its nvidia-smi first on
    PATH, which ddpcli runs afresh for each command (no interpreter and torch per call)."""
    monkeypatch.setenv("PATH", node_with_gpus_torch_cannot_use(tmp_path)["PATH"])
    return in_process


needs_a_cuda_build = pytest.mark.skipif(
    torch.version.cuda is None or torch.cuda.is_available(),
    reason="needs a CUDA build of torch that sees no GPU",
)


@needs_a_cuda_build
@pytest.mark.parametrize("gpus", [[], ["--gpus", "0,1"]])
def test_train_refuses_gpus_torch_cannot_use_naming_both_versions(tmp_path, on_that_node, gpus):
    result = on_that_node("train", *gpus, "--dry-run", "--out", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert f"CUDA {torch.version.cuda}" in lines[0] and "driver 535.104.05" in lines[0]
    assert "--cpu" in lines[0]
    assert "Traceback" not in result.stderr


@needs_a_cuda_build
def test_cpu_still_runs_on_a_node_whose_gpus_torch_cannot_use(tmp_path, on_that_node):
    result = on_that_node("train", "--cpu", "--dry-run", "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-2000:]


@needs_a_cuda_build
def test_bench_barrier_refuses_gpus_torch_cannot_use(on_that_node):
    result = on_that_node("bench-barrier", "--gpus", "0", "--iters", "3")
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"CUDA {torch.version.cuda}" in result.stderr and "driver 535.104.05" in result.stderr


@needs_a_cuda_build
def test_check_env_fails_the_cuda_row_in_the_same_words(on_that_node):
    result = on_that_node("check-env", "--json")
    assert result.returncode == 1, result.stderr[-2000:]
    row = next(row for row in json.loads(result.stdout)["checks"] if row["name"] == "CUDA")
    assert row["status"] == "fail"
    assert f"CUDA {torch.version.cuda}" in row["detail"] and "driver 535.104.05" in row["detail"]
    assert "8 GPU(s) nvidia-smi lists" in row["detail"]


def test_under_a_launcher_gpus_torch_cannot_use_are_refused(tmp_path, monkeypatch):
    """torchrun's ranks resolve in-process: the same refusal, not `cpu` set quietly."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(resolve, "physical_gpu_count", lambda: 8)
    monkeypatch.setattr(resolve, "nvidia_driver_version", lambda: "535.104.05")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launcher = LauncherEnv(rank=0, local_rank=0, world_size=8, local_world_size=8)
    with pytest.raises(DdpcliError) as refused:
        plan_run(TrainConfig(out=tmp_path), launcher)
    assert refused.value.exit_code == 2
    assert "CUDA 13.0" in refused.value.message and "driver 535.104.05" in refused.value.message
    assert "580" in refused.value.message  # the driver CUDA 13 needs
    cpu = plan_run(TrainConfig(out=tmp_path, cpu=True), launcher)
    assert cpu.cpu


@pytest.mark.gpu
def test_a_gpu_node_passes_the_cuda_check_and_names_its_driver(tmp_path):
    from ddpcli.machine import nvidia_driver_version

    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", nvidia_driver_version() or "")
    result = run_cli("train", "--gpus", "0", "--dry-run", "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "cannot use" not in result.stderr


# --- TORCH_NCCL_ASYNC_ERROR_HANDLING: torch's default, not ddpcli's ---------------------------


def test_an_nccl_group_keeps_torchs_async_error_handling(monkeypatch):
    """torch 2.14's default (3) ends a rank on a failed collective without ncclCommAbort,
    which can itself hang; ddpcli used to set 1 (abort first). It sets nothing now."""
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    joined: list[dict] = []
    monkeypatch.setattr(dist_module, "choose_device", lambda *args: torch.device("cuda", 0))
    monkeypatch.setattr(dist_module.dist, "init_process_group", lambda **kw: joined.append(kw))
    env = LauncherEnv(rank=0, local_rank=0, world_size=2, local_world_size=2)
    ctx = dist_module.init_distributed(
        env, want_gpu=True, backend="auto", init_method="tcp://127.0.0.1:29999", timeout_s=5
    )
    assert ctx.backend == "nccl" and joined[0]["backend"] == "nccl"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ


NCCL_RANK = """
import os, sys, torch
from ddpcli.dist import init_distributed, shutdown
from ddpcli.environments import LauncherEnv
env = LauncherEnv(rank=0, local_rank=0, world_size=1, local_world_size=1)
init_distributed(env, want_gpu=True, backend="nccl", init_method=sys.argv[1], timeout_s=60)
torch.distributed.barrier()
print(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "unset"))
shutdown()
"""


@pytest.mark.gpu
def test_a_real_nccl_group_leaves_async_error_handling_unset(tmp_path):
    from conftest import run_bounded

    command = [sys.executable, "-c", NCCL_RANK, f"file://{tmp_path / 'init'}"]
    environment = {
        name: value for name, value in clean_env().items() if "ASYNC_ERROR_HANDLING" not in name
    }
    result = run_bounded(command, 120, environment)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "unset"
