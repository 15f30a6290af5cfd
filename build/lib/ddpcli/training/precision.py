"""What `--precision auto` becomes on this machine, and the reason the header gives.

On GPUs: bf16 from compute capability 8.0 (Ampere) on, where the tensor cores run bf16 and
cuDNN has bf16 convolutions; a V100 (7.0) or T4 (7.5) keeps fp32, since there bf16 is emulated
(torch.cuda.is_bf16_supported() counts emulation) and convolutions take a slow path. TF32,
which fp32 runs use, starts at 8.0 too. On the CPU: bf16 autocast only where both hold:
- the processor computes bf16 dot products natively (AVX512_BF16 or AMX-BF16), so oneDNN's
  bf16 convolutions and matmuls run about twice as many multiply-adds per instruction as
  fp32; without them, bf16 is emulated through fp32 and only adds the casts;
- the model spends its time in dense convolutions and matmuls, where that gain lands.
  Depthwise convolutions (MobileNet, EfficientNet, MNASNet, ShuffleNet) do a few
  multiply-adds per byte they load: they are bound by memory, not by the dot-product
  units, and autocast's casts around them cost more than bf16 saves. A model given as
  `pkg.module:factory` is unknown, so it keeps fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

# torchvision families built from depthwise (grouped) convolutions: fp32 under `auto`.
DEPTHWISE_FAMILIES = ("mobilenet", "efficientnet", "mnasnet", "shufflenet")
# cpuinfo's names (torch.cpu.get_capabilities) for native bf16 dot products, best first.
NATIVE_BF16_FEATURES = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512_BF16"}


# Ampere: bf16 and TF32 tensor cores, and cuDNN's bf16 convolutions.
AMPERE = (8, 0)


class PrecisionChoice(NamedTuple):
    precision: str
    reason: str


def native_cpu_bf16() -> str | None:
    """The CPU feature that gives native bf16 dot products ("AMX-BF16", "AVX512_BF16"), or
    None. Asked of torch (cpuinfo, and whether oneDNN is built in), not of /proc/cpuinfo."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return None
    try:
        capabilities = torch.cpu.get_capabilities()
    except (AttributeError, RuntimeError):  # an older torch: no cpuinfo query
        return None
    for feature, name in NATIVE_BF16_FEATURES.items():
        if capabilities.get(feature):
            return name
    return None


def bf16_pays_for(arch: str) -> bool:
    """True for models whose time is in dense convolutions and matmuls (the built-in CNNs,
    ResNets, VGG, RegNets, ConvNeXt, ViT, ...); see the module's docstring."""
    if ":" in arch:
        return False
    return not arch.startswith(DEPTHWISE_FAMILIES)


def auto_cpu_precision(arch: str, native_bf16: str | None) -> PrecisionChoice:
    """`--precision auto` on the CPU, for ARCH on a processor with NATIVE_BF16 (or none)."""
    if native_bf16 is None:
        return PrecisionChoice("fp32", "auto: this CPU has no native bf16 (AVX512_BF16 or AMX)")
    if not bf16_pays_for(arch):
        why = "not a known model" if ":" in arch else "built on memory-bound depthwise convolutions"
        return PrecisionChoice("fp32", f"auto: {arch} is {why}; bf16 pays for dense convs")
    return PrecisionChoice(
        "bf16", f"auto: the CPU has {native_bf16} and {arch} is conv/matmul-bound"
    )


def gpu_capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of DEVICE, a CUDA device: (8, 0) for an A100."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return major, minor


def has_tf32(device: torch.device) -> bool:
    """Whether fp32 matmuls and convolutions on DEVICE run on TF32 tensor cores."""
    return device.type == "cuda" and gpu_capability(device) >= AMPERE


def auto_gpu_precision(capability: tuple[int, int]) -> PrecisionChoice:
    """`--precision auto` on a GPU of compute CAPABILITY."""
    named = f"compute capability {capability[0]}.{capability[1]}"
    if capability >= AMPERE:
        return PrecisionChoice("bf16", f"auto: the GPU ({named}) has bf16 tensor cores")
    return PrecisionChoice(
        "fp32", f"auto: the GPU ({named}) emulates bf16; --precision fp16 uses its tensor cores"
    )
