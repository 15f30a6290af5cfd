"""What `--precision auto` becomes on this machine, and the reason the header gives.

On GPUs: bf16 from compute capability 8.0 (Ampere) on, where the tensor cores run bf16 and
cuDNN has bf16 convolutions; a V100 (7.0) or T4 (7.5) keeps fp32, since there bf16 is emulated
(torch.cuda.is_bf16_supported() counts emulation) and convolutions take a slow path. TF32,
which fp32 runs use, starts at 8.0 too. From 8.0, bf16 only where the step is large enough to
pay for it: a step of small kernels is bound by the host issuing them one by one, and
autocast adds a cast kernel beside each convolution, so there fp32 on TF32 tensor cores is
faster, unless CUDA graphs (--compile-mode reduce-overhead or max-autotune) take the launch
cost away. "Small" is the training FLOPs of one step on one GPU, known before the run
(LAUNCH_BOUND_GFLOP; the measurements behind it are in docs/performance.md, "GPU figures").
On the CPU: bf16 autocast only where both hold:
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

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ddpcli.factories import is_factory_spec, timm_model_name

if TYPE_CHECKING:
    import torch

# torchvision families built from depthwise (grouped) convolutions: fp32 under `auto`.
DEPTHWISE_FAMILIES = ("mobilenet", "efficientnet", "mnasnet", "shufflenet")
# cpuinfo's names (torch.cpu.get_capabilities) for native bf16 dot products, best first.
NATIVE_BF16_FEATURES = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512_BF16"}


# Ampere: bf16 and TF32 tensor cores, and cuDNN's bf16 convolutions.
AMPERE = (8, 0)
# Training GFLOP per step on one GPU below which a step is launch-bound (the host's kernel
# launches, not the GPU, set its pace): placed between the two steps measured on one H100,
# one launch-bound where fp32 (TF32) beat bf16 and one compute-bound (docs/performance.md).
LAUNCH_BOUND_GFLOP = 600.0
# The forward and the backward (about twice the forward): a training step's FLOPs per image.
TRAINING_FLOPS_PER_FORWARD = 3
# The classifier's width when counting: the head is a negligible share of a step's FLOPs.
FLOP_COUNT_CLASSES = 10


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


def auto_gpu_precision(
    capability: tuple[int, int], step_gflop: float | None = None, cuda_graphs: bool = False
) -> PrecisionChoice:
    """`--precision auto` on a GPU of compute CAPABILITY, for a training step of STEP_GFLOP
    on each GPU (None: not known, e.g. evaluation, or a model that cannot be counted), with
    or without CUDA_GRAPHS."""
    named = f"compute capability {capability[0]}.{capability[1]}"
    if capability < AMPERE:
        return PrecisionChoice(
            "fp32", f"auto: the GPU ({named}) emulates bf16; --precision fp16 uses its tensor cores"
        )
    tensor_cores = f"auto: the GPU ({named}) has bf16 tensor cores"
    if step_gflop is None:
        return PrecisionChoice("bf16", tensor_cores)
    size = f"{step_gflop:,.0f} GFLOP per step on each GPU"
    if cuda_graphs:
        return PrecisionChoice(
            "bf16", f"{tensor_cores}, and CUDA graphs take the launch cost of a step of "
            f"small kernels ({size}) away"
        )  # fmt: skip
    if step_gflop < LAUNCH_BOUND_GFLOP:
        return PrecisionChoice(
            "fp32", f"auto: a launch-bound step on the GPU ({named}; {size}, under "
            f"{LAUNCH_BOUND_GFLOP:,.0f}) without CUDA graphs: bf16's casts cost more than it "
            "saves"
        )  # fmt: skip
    return PrecisionChoice("bf16", f"{tensor_cores} and the step is compute-bound ({size})")


def training_gflop_per_step(
    arch: str, image_size: int, per_gpu_batch: int, model_args: Mapping[str, Any] | None = None
) -> float | None:
    """The FLOPs of one training step on one GPU, in GFLOP (training_gflop_per_image times
    the per-GPU batch). None for a model of the user's own code or timm's (built again on
    every rank, it might load weights, even download them) and where the model cannot be
    built or run on the meta device."""
    if is_factory_spec(arch) or timm_model_name(arch) is not None:
        return None
    try:
        per_image = training_gflop_per_image(arch, image_size, model_args)
    except Exception:  # counting is advice: a model it cannot count keeps the plain rule
        return None
    return per_image * per_gpu_batch if per_image else None


def training_gflop_per_image(
    arch: str, image_size: int, model_args: Mapping[str, Any] | None = None
) -> float:
    """One training image's FLOPs, in GFLOP: one image's forward times
    TRAINING_FLOPS_PER_FORWARD, counted by torch's FlopCounterMode on the meta device: no
    memory, no arithmetic (a resnet50 in a tenth of a second). benchmarks/ take MFU from it."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ddpcli.models.build import build_model

    counter = FlopCounterMode(display=False)
    with torch.device("meta"):
        model = build_model(arch, FLOP_COUNT_CLASSES, model_args).eval()
    with counter, torch.no_grad():
        model(torch.zeros(1, 3, image_size, image_size, device="meta"))
    return TRAINING_FLOPS_PER_FORWARD * counter.get_total_flops() / 1e9
