"""benchmarks/gpu_throughput.py's arithmetic: MFU is one GPU's FLOP/s over one GPU's peak."""

from pathlib import Path

import pytest
from conftest import benchmark_module


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("gpu_throughput") as module:
        yield module


def test_mfu_divides_the_rate_of_every_rank_by_every_gpu(bench):
    # 8 GPUs at 4000 img/s each, 12 GFLOP per training image: 48 TFLOP/s per GPU.
    assert bench.tflops_per_gpu(32_000, 12.0, gpus=8) == pytest.approx(48.0)
    assert bench.mfu(32_000, 12.0, gpus=8, peak=960.0) == pytest.approx(0.05)
    one = bench.mfu(4_000, 12.0, gpus=1, peak=960.0)
    assert bench.mfu(32_000, 12.0, gpus=8, peak=960.0) == pytest.approx(one)


def test_the_table_column_uses_the_contenders_gpu_count(bench):
    assert bench.flops_column(32_000, 12.0, 8, 960.0) == "5.00"  # per cent
    assert bench.flops_column(None, 12.0, 8, 960.0) == "-"


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Tesla T4", None),
    ],
)
def test_peaks_are_dense_bf16_per_card(bench, name, peak):
    assert bench.peak_tflops(name) == peak


def test_mfu_is_quoted_at_resnet50_224_beside_the_launch_bound_model(bench):
    setup = bench.Setup(cpu=False, arch="resnet18", image_size=96, batch=128, steps=50,
                        nproc=2, max_nproc=2, workers=4, precision="bf16", threads=8)  # fmt: skip
    contenders = bench.mfu_contenders(setup)
    assert {c.model(setup) for c in contenders} == {("resnet50", 224)}
    command = bench.contender_command(contenders[0], setup, Path("/tmp/x"), 2)
    assert command[command.index("--arch") + 1] == "resnet50"
    assert command[command.index("--image-size") + 1] == "224"
    assert bench.mfu_contenders(bench.Setup(**{**setup.__dict__, "cpu": True})) == []
