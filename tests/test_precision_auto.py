"""`--precision auto` on the CPU: bf16 where the processor has native bf16 and the model is
one where it pays, fp32 otherwise, and the header says which and why. The capability probe
is replaced both ways, so the tests hold on any CPU."""

from __future__ import annotations

import pytest
import torch
from test_speed_paths import train_in_process

from ddpcli.config import build_train_config
from ddpcli.errors import DdpcliError
from ddpcli.launcher.plan import plan_run
from ddpcli.training.precision import native_cpu_bf16


def resolve(tmp_path, **flags):
    flags = {"cpu": True, "out": tmp_path, **flags}
    return plan_run(build_train_config(flags, None), None)


@pytest.fixture
def bf16_cpu(monkeypatch):
    monkeypatch.setattr("ddpcli.launcher.resolve.native_cpu_bf16", lambda: "AMX-BF16")


@pytest.fixture
def plain_cpu(monkeypatch):
    monkeypatch.setattr("ddpcli.launcher.resolve.native_cpu_bf16", lambda: None)


@pytest.mark.parametrize("arch", ["tinycnn", "smallcnn", "resnet18", "vit_b_16"])
def test_auto_is_bf16_for_dense_models_on_a_cpu_with_native_bf16(tmp_path, bf16_cpu, arch):
    cfg = resolve(tmp_path, arch=arch)
    assert cfg.precision == "bf16"
    assert cfg.precision_reason == f"auto: the CPU has AMX-BF16 and {arch} is conv/matmul-bound"
    assert '"precision":"bf16"' in cfg.model_dump_json()  # what config.json records


@pytest.mark.parametrize("arch", ["mobilenet_v2", "efficientnet_b0", "shufflenet_v2_x1_0"])
def test_auto_keeps_fp32_for_depthwise_models(tmp_path, bf16_cpu, arch):
    cfg = resolve(tmp_path, arch=arch)
    assert cfg.precision == "fp32" and "depthwise" in cfg.precision_reason


def test_auto_is_fp32_without_native_bf16(tmp_path, plain_cpu):
    cfg = resolve(tmp_path, arch="resnet18")
    assert cfg.precision == "fp32"
    assert cfg.precision_reason == "auto: this CPU has no native bf16 (AVX512_BF16 or AMX)"


def test_a_given_precision_is_kept(tmp_path, bf16_cpu):
    cfg = resolve(tmp_path, arch="resnet18", precision="fp32")
    assert cfg.precision == "fp32" and cfg.precision_reason is None


def test_precision_reason_is_not_a_setting(tmp_path):
    with pytest.raises(DdpcliError, match="not a setting") as error:
        build_train_config({"precision_reason": "mine"}, None)
    assert error.value.exit_code == 2


def test_the_header_says_which_and_why(tmp_path, bf16_cpu, capfd):
    cfg = resolve(tmp_path, arch="tinycnn", image_size=16, per_gpu_batch=8,
                  synthetic_size=32, epochs=1, nproc=1, workers=0, max_steps=1)  # fmt: skip
    _, metrics = train_in_process(cfg)
    assert torch.isfinite(torch.tensor(metrics["train_loss"]))
    header = capfd.readouterr().err
    assert "precision bf16 (auto: the CPU has AMX-BF16 and tinycnn is conv/matmul-bound)" in header


def test_the_probe_answers_on_this_machine():
    answer = native_cpu_bf16()
    capabilities = torch.cpu.get_capabilities()
    native = capabilities.get("amx_bf16") or capabilities.get("avx512_bf16")
    assert (answer is not None) == bool(native and torch.backends.mkldnn.is_available())
