"""`ddpcli train`'s configuration: the TrainConfig schema, recipes, and the one place that
turns flags, a recipe and ddpcli's own environment variables into it.

Precedence: built-in defaults < recipe file < command-line flags. `ddpcli.launcher.resolve` then
fills every "auto" value from the machine, so `config.json` holds what really ran.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ddpcli.config.common import (
    CHANGES_RESULT,
    FLAG_SPELLINGS,
    FROM_ENVIRONMENT,
    PART_OF_ANOTHER_FLAG,
    PER_NODE,
    Backend,
    CommandConfig,
    DatasetName,
    Excluded,
    GpuList,
    Membership,
    Precision,
    RdzvBackend,
    check_membership,
    check_node_rank,
    check_strict_types,
    describe_validation_error,
    exclusion_in,
    from_comma_text,
    given,
    nproc_spec,
    parse_float_list,
    pod_defaults,
    refuse_resolved,
    split_nnodes,
    with_origins,
)
from ddpcli.config.data import DataLocation, is_url
from ddpcli.config.facts import RunFacts
from ddpcli.environments.pods import describe as describe_pod
from ddpcli.environments.pods import pet_variables
from ddpcli.errors import DdpcliError, usage_error
from ddpcli.factories import is_factory_spec
from ddpcli.models.archs import BUILTIN_ARCHS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# DDPCLI_TRACE_SAMPLES=PATH: each rank appends the sample indices of every training batch it
# is handed to PATH.rankN, one JSON line per batch. A debugging aid, and the evidence the
# resume tests use that no sample is trained twice or missed (docs/checkpoints.md).
TRACE_SAMPLES_VARIABLE = "DDPCLI_TRACE_SAMPLES"
# DDPCLI_SLOW_DATA=RANK:SECONDS: rank RANK waits SECONDS more for each training batch. A
# straggler made on purpose, to see (and test) what the run reports about it.
SLOW_DATA_VARIABLE = "DDPCLI_SLOW_DATA"
# DDPCLI_FAKE_OOM=RANK:PHASE:BATCH[:STEP],...: rank RANK raises torch.OutOfMemoryError in
# PHASE (forward, backward or step) whenever its micro-batch is BATCH or more, once STEP
# optimizer steps are done (0: from the start, the batch search included). An out-of-memory
# made on purpose, to test on the CPU what --per-gpu-batch auto does with a real one.
FAKE_OOM_VARIABLE = "DDPCLI_FAKE_OOM"
OOM_PHASES = ("forward", "backward", "step")
# The data sets read as JPEG files during training, which --decode gpu decodes on the rank.
JPEG_DATASETS = ("imagefolder", "shards")
# --per-gpu-batch's default, and what --per-gpu-batch auto's global batch is made of when
# --global-batch is not given.
DEFAULT_PER_GPU_BATCH = 64
# Below a second no rank can even join: init and every collective are bounded by --timeout.
MIN_TIMEOUT_S = 1.0

LrScaling = Literal["linear", "sqrt", "none"]
Optimizer = Literal["sgd", "adamw"]

# --lr's default, per 256 images: the ResNet-with-SGD reference rate for torchvision's
# models; the built-in small nets (three BN conv layers) learn best at twice it, measured on
# the synthetic set (docs/performance.md, "The default learning rate").
REFERENCE_LR = 0.1
BUILTIN_NET_LR = 0.2


# AdamW: a common starting rate per 256 images (timm's and DeiT's recipes sit near it),
# grown with the square root of the batch as timm does for adaptive optimisers; its
# decoupled weight decay needs a far larger coefficient than SGD's L2 term to matter.
ADAMW_LR = 1e-3
# What each optimiser uses unless the flags or the recipe say otherwise.
OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {
    "sgd": {"lr_scaling": "linear", "weight_decay": 5e-4, "momentum": 0.9},
    "adamw": {"lr_scaling": "sqrt", "weight_decay": 0.05, "betas": [0.9, 0.999]},
}


def default_lr(arch: str, optimizer: str = "sgd") -> float:
    if optimizer == "adamw":
        return ADAMW_LR
    return BUILTIN_NET_LR if arch in BUILTIN_ARCHS else REFERENCE_LR


def scaled_lr(lr: float, global_batch: int, base_batch: int, rule: LrScaling) -> float:
    """The peak rate for a GLOBAL_BATCH when LR is the rate for BASE_BATCH images.

    linear: LR x global/base, the rule of Goyal et al. (2017) that torchvision's and timm's
    references follow (0.1 per 256 images for ResNets with SGD); sqrt: LR x the square root
    of global/base, gentler for large batches and often used with adaptive optimizers;
    none: LR as given, whatever the batch.
    """
    if rule == "none":
        return lr
    ratio = global_batch / base_batch
    rate = lr * (ratio if rule == "linear" else math.sqrt(ratio))
    return float(f"{rate:.12g}")  # 0.0375, not 0.037500000000000006, in config.json


def describe_lr(lr: float, global_batch: int, base_batch: int, rule: LrScaling) -> str:
    """`lr 0.1 per 256 images -> 0.025 at global batch 64 (linear)`: the rule and its result."""
    if rule == "none":
        return f"lr {lr:g} at global batch {global_batch} (as given: --lr-scaling none)"
    peak = scaled_lr(lr, global_batch, base_batch, rule)
    return f"lr {lr:g} per {base_batch} images -> {peak:g} at global batch {global_batch} ({rule})"


def accumulate_keeping(global_batch: int, per_gpu_batch: int, world_size: int) -> int | None:
    """The accumulation that keeps GLOBAL_BATCH at WORLD_SIZE ranks of PER_GPU_BATCH
    (4 x 16 -> 2 x 16 x 2), or None when that world cannot hold it in whole micro-batches."""
    per_micro_step = per_gpu_batch * world_size
    if global_batch % per_micro_step:
        return None
    return global_batch // per_micro_step


def global_batch_of(
    per_gpu_batch: int, world_size: int, accumulate: int, micro_batches_per_epoch: int | None = None
) -> int:
    """The images one optimizer step takes: an epoch of fewer micro-batches than ACCUMULATE
    caps what a step holds."""
    return per_gpu_batch * world_size * min(accumulate, micro_batches_per_epoch or accumulate)


def toml_value(text: str) -> Any:
    """`4` -> 4, `0.5` -> 0.5, `true` -> True, `[1, 2]` -> [1, 2], `"relu"` -> "relu"; text
    that is not a TOML value (`relu`) is taken as the string it is."""
    try:
        return tomllib.loads(f"value = {text.strip()}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def parse_model_args(value: Any) -> Any:
    """`--model-arg KEY=VALUE`, repeatable, as a dict; a recipe may give the table itself."""
    if not isinstance(value, (list, tuple)):
        return value
    parsed: dict[str, Any] = {}
    for item in value:
        key, equals, text = str(item).partition("=")
        key = key.strip()
        if not equals or not key.isidentifier():
            raise ValueError("give KEY=VALUE with KEY a keyword of the factory, e.g. depth=4")
        if key in parsed:
            raise ValueError(f"{key} is given twice; keep one")
        parsed[key] = toml_value(text)
    return parsed


def _valid_betas(value: list[float]) -> list[float]:
    if len(value) != 2 or not all(0 <= beta < 1 for beta in value):
        raise ValueError("give two numbers in [0, 1), e.g. --betas 0.9,0.999")
    return value


# `--betas 0.9,0.999`: AdamW's moving-average coefficients.
Betas = Annotated[
    list[float], from_comma_text(parse_float_list, "betas"), AfterValidator(_valid_betas)
]

# `--model-arg depth=4 --model-arg act=relu`: keywords for the model's constructor.
ModelArgs = Annotated[dict[str, Any], BeforeValidator(parse_model_args)]

TrackerName = Literal["csv", "mlflow", "wandb", "tensorboard"]


def parse_name_list(text: str, name: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _each_once(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


# `--tracker csv,mlflow`: experiment trackers, each named once.
TrackerList = Annotated[
    list[TrackerName], from_comma_text(parse_name_list, "tracker"), AfterValidator(_each_once)
]

# --grad-compression: what DDP all-reduces (ddpcli.training.compression). PowerSGD's rank 4:
# on the digits folder rank 2 (Vogels et al.'s choice for ResNets on CIFAR-10) cost about 4
# points and rank 4 stayed within the noise (docs/performance.md); its first steps go
# uncompressed, as torch's PowerSGD recommends.
GRAD_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
# torch.compile's modes that capture CUDA graphs (inductor's `triton.cudagraphs`).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
POWERSGD_DEFAULT_RANK = 4
POWERSGD_MAX_RANK = 64


def parse_grad_compression(value: str) -> str:
    """`none`, `fp16`, `bf16`, or `powersgd:RANK` (`powersgd` alone: the default rank)."""
    method, colon, rank = value.strip().lower().partition(":")
    if method not in GRAD_COMPRESSIONS or (colon and method != "powersgd"):
        raise ValueError("use none, fp16, bf16, powersgd or powersgd:RANK (e.g. powersgd:2)")
    if method != "powersgd":
        return method
    if not colon:
        return f"powersgd:{POWERSGD_DEFAULT_RANK}"
    if not rank.isdigit() or not 1 <= int(rank) <= POWERSGD_MAX_RANK:
        raise ValueError(f"PowerSGD's rank is a whole number from 1 to {POWERSGD_MAX_RANK}")
    return f"powersgd:{int(rank)}"


def powersgd_rank(grad_compression: str) -> int | None:
    """The rank of `powersgd:RANK`; None for the other compressions."""
    method, _, rank = grad_compression.partition(":")
    return int(rank) if method == "powersgd" else None


GradCompression = Annotated[str, AfterValidator(parse_grad_compression)]


def parse_profile_steps(value: str) -> str:
    """`A:B`: the optimizer steps after step A up to step B (step numbers as in steps.jsonl)."""
    first, colon, last = value.strip().partition(":")
    if not (colon and first.strip().isdigit() and last.strip().isdigit()):
        raise ValueError("give A:B, two step numbers, e.g. 10:15 (the 5 steps after step 10)")
    if int(first) >= int(last):
        raise ValueError("A must be below B: 10:15 profiles the 5 steps after step 10")
    return f"{int(first)}:{int(last)}"


# --profile-steps A:B (ddpcli.training.profiling).
ProfileSteps = Annotated[str, AfterValidator(parse_profile_steps)]


class TrainConfig(Membership, CommandConfig):
    """Everything `ddpcli train` needs. Field names are the flags with `_` for `-`; a
    field's kinds (per node, changes the result, ...: ddpcli.config.common.Kind) are marked
    in its annotation, and the lists of them are read from there."""

    # The request: validated once, never rewritten (what the run resolves is its RunPlan).
    model_config = ConfigDict(frozen=True)

    # data
    # A built-in set's name, or the user's own factory (`pkg.module:factory`).
    dataset: Annotated[str, CHANGES_RESULT] = "synthetic"
    # A folder, or for --dataset shards a URL (s3://, gs://, http(s)://): saved without the
    # URL's user:password@ (config.data.DataLocation).
    data_dir: Annotated[DataLocation | None, PER_NODE] = None
    download: Annotated[bool, PER_NODE] = False
    image_size: Annotated[int | None, CHANGES_RESULT] = Field(None, ge=8, le=1024)
    synthetic_size: Annotated[int, CHANGES_RESULT] = Field(
        4096, ge=16, description="training images of the synthetic set"
    )
    data_path: Annotated[Literal["auto", "device", "loader"], PER_NODE] = "auto"
    # Where JPEGs are decoded on the loader path and from shards: in the loader workers
    # (cpu), or batched on the rank's device (gpu: nvjpeg; ddpcli.data.encoded).
    decode: Annotated[Literal["auto", "cpu", "gpu"], PER_NODE] = "auto"
    workers: Annotated[int | None, PER_NODE] = Field(
        None, ge=0, description="DataLoader workers per rank"
    )
    skip_bad_images: bool = Field(
        False,
        description="leave out image files that cannot be decoded (counted, listed in "
        "summary.json) instead of stopping; the loader path then decodes each image once "
        "before training to find them",
    )
    shuffle_buffer: int | None = Field(
        None,
        ge=1,
        description="--dataset shards: samples each stream holds to shuffle (1: none); by "
        "default sized from the node's available memory, stated before the first step",
    )
    augment: Annotated[Literal["auto", "rrc", "crop-flip", "none"], CHANGES_RESULT] = "auto"
    # the modern recipe's input side (docs/train.md, "The modern recipe")
    auto_augment: Annotated[
        Literal["ta_wide", "randaugment", "autoaugment", "none"], CHANGES_RESULT
    ] = Field(
        "none",
        description="a torchvision policy on each training image after its crop: "
        "TrivialAugmentWide, RandAugment or AutoAugment (ImageNet)",
    )
    random_erase: Annotated[float, CHANGES_RESULT] = Field(
        0.0, ge=0, le=1, description="probability of erasing a random box of each training image"
    )
    mixup_alpha: Annotated[float, CHANGES_RESULT] = Field(
        0.0, ge=0, description="Mixup's Beta(alpha, alpha); 0: off"
    )
    cutmix_alpha: Annotated[float, CHANGES_RESULT] = Field(
        0.0, ge=0, description="CutMix's Beta(alpha, alpha); 0: off"
    )
    ra_reps: Annotated[int, CHANGES_RESULT] = Field(
        1,
        ge=1,
        description="repeated augmentation: each image on this many ranks per epoch, each "
        "with its own augmentation; 1: off",
    )
    train_crop_size: Annotated[int | None, CHANGES_RESULT] = Field(None, ge=8, le=1024)
    val_resize_size: Annotated[int | None, CHANGES_RESULT] = Field(None, ge=8, le=2048)
    val_crop_size: Annotated[int | None, CHANGES_RESULT] = Field(None, ge=8, le=1024)
    # model and optimisation
    arch: Annotated[str | None, CHANGES_RESULT] = None
    model_args: Annotated[ModelArgs, CHANGES_RESULT] = Field(default_factory=dict)
    init_from: Path | None = Field(
        None,
        description="start from these weights (a ddpcli checkpoint, a `checkpoint convert` "
        "output, a .safetensors file or a state dict); not a resume: step, optimiser and "
        "schedule start fresh",
    )
    reset_head: bool = Field(
        False,
        description="with --init-from: leave the final classifier as built, for another "
        "number of classes (fine-tuning)",
    )
    epochs: Annotated[int, CHANGES_RESULT] = Field(5, ge=1)
    # "auto": the micro-batch is searched on each rank's device, and the global batch kept
    # (ddpcli.training.microbatch).
    per_gpu_batch: Annotated[int | Literal["auto"], CHANGES_RESULT] = DEFAULT_PER_GPU_BATCH
    accumulate: Annotated[int, CHANGES_RESULT] = Field(1, ge=1)
    # One optimizer step's images over every rank: --accumulate follows from it (or, with
    # --per-gpu-batch auto, each process's share); None: per-gpu-batch x world x accumulate.
    global_batch: Annotated[int | None, CHANGES_RESULT] = Field(None, ge=1)
    lr: Annotated[float | None, CHANGES_RESULT] = Field(
        None, gt=0
    )  # None: default_lr(arch), set once the arch is known
    lr_base_batch: Annotated[int, CHANGES_RESULT] = Field(256, ge=1)
    # None below: the optimiser's default (OPTIMIZER_DEFAULTS), filled in with it.
    lr_scaling: Annotated[LrScaling | None, CHANGES_RESULT] = None
    optimizer: Annotated[Optimizer, CHANGES_RESULT] = "sgd"
    momentum: Annotated[float | None, CHANGES_RESULT] = Field(
        None, ge=0, lt=1
    )  # SGD's; None with AdamW
    betas: Annotated[Betas | None, CHANGES_RESULT] = None
    weight_decay: Annotated[float | None, CHANGES_RESULT] = Field(None, ge=0)
    warmup_epochs: Annotated[float, CHANGES_RESULT] = Field(1.0, ge=0)
    label_smoothing: Annotated[float, CHANGES_RESULT] = Field(0.0, ge=0, lt=1)
    norm_weight_decay: Annotated[float, CHANGES_RESULT] = Field(
        0.0, ge=0, description="weight decay of normalisation layers' weights and biases"
    )
    sync_bn: Annotated[bool, CHANGES_RESULT] = Field(
        False, description="BatchNorm statistics over the global batch (all ranks)"
    )
    ema: Annotated[bool, CHANGES_RESULT] = Field(
        False,
        description="keep an exponential moving average of the weights, validated beside them",
    )
    ema_decay: Annotated[float, CHANGES_RESULT] = Field(
        0.99998,
        gt=0,
        lt=1,
        description="EMA decay per update at global batch x --ema-steps / --epochs = 1",
    )
    ema_steps: Annotated[int, CHANGES_RESULT] = Field(
        32, ge=1, description="optimizer steps between EMA updates"
    )
    seed: Annotated[int, CHANGES_RESULT] = Field(0, ge=0)
    precision: Annotated[Precision, CHANGES_RESULT] = "auto"
    compile: bool = False
    # torch.compile's mode: reduce-overhead captures CUDA graphs (docs/train.md, "Compile").
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    max_steps: int | None = Field(None, ge=1)
    # processes and devices
    gpus: Annotated[GpuList, PER_NODE] = None
    cpu: bool = False
    nproc: int | None = Field(None, ge=1, le=1024)
    backend: Backend = "auto"
    strategy: Literal["ddp", "dp", "balanced-dp"] = "ddp"
    gpu0_batch: int | None = Field(None, ge=1)
    bucket_cap_mb: float = Field(
        25.0, gt=0, description="DDP gradient bucket size (MB): fewer, larger all-reduces"
    )
    find_unused_parameters: bool = Field(
        False,
        description="DDP: train a model whose loss leaves some parameters out (a branch not "
        "taken); costs a walk of the autograd graph every step",
    )
    flight_recorder: bool = Field(
        True,
        description="torch's flight recorder in every rank: when ranks stop agreeing, a "
        "verdict naming the rank, the collective and the line that issued it",
    )
    # DDP's settings for slow links (docs/performance.md, "DDP on slow links"): today's
    # behaviour until the scaling measurements choose the defaults.
    static_graph: bool = Field(
        False,
        description="DDP: the same parameters get gradients in the same order every step; "
        "lets DDP skip per-step bookkeeping",
    )
    gradient_as_bucket_view: bool = Field(
        True,
        description="DDP: gradients live inside the all-reduce buckets (no copy into and out "
        "of them, less memory)",
    )
    grad_compression: Annotated[GradCompression, CHANGES_RESULT] = Field(
        "none",
        description="what DDP all-reduces: fp32 gradients (none), fp16 or bf16 casts (half "
        "the bytes), or PowerSGD's rank-RANK factors with error feedback (docs/performance.md)",
    )
    powersgd_start_step: Annotated[int, CHANGES_RESULT] = Field(
        1000,
        ge=0,
        description="optimizer steps all-reduced uncompressed before PowerSGD starts",
    )
    # multi-node
    nnodes: int = Field(1, ge=1)  # the most nodes; `--nnodes MIN:MAX` sets both
    min_nnodes: Annotated[int | None, PART_OF_ANOTHER_FLAG] = Field(
        None, ge=1
    )  # None: exactly --nnodes
    node_rank: Annotated[int, PER_NODE] = Field(0, ge=0)
    master_addr: Annotated[str, PER_NODE] = "127.0.0.1"
    master_port: Annotated[int | None, PER_NODE] = Field(None, ge=1, le=65535)
    rdzv_backend: RdzvBackend | None = None  # None: c10d for MIN:MAX, else static
    rdzv_endpoint: str | None = None  # None: --master-addr:--master-port
    rdzv_id: str | None = None
    init_method: Annotated[str | None, PER_NODE] = None
    ifname: Annotated[str | None, PER_NODE] = None
    timeout: Annotated[float, PER_NODE] = Field(
        300.0, description="seconds for init and every collective"
    )
    max_restarts: int = Field(0, ge=0)
    # outputs
    out: Annotated[Path | None, PER_NODE] = None
    resume: Annotated[str | None, PER_NODE] = None
    overwrite: bool = False
    save_every_steps: int | None = Field(None, ge=1)
    keep_last: int = Field(3, ge=0)
    log_dir: Annotated[Path | None, PER_NODE] = None
    log_every: int = Field(
        10, ge=1, description="optimizer steps between progress lines and steps.jsonl rows"
    )
    profile_steps: ProfileSteps | None = Field(
        None,
        description="A:B: one torch.profiler trace per rank of the steps after step A up to "
        "step B, in OUT/profile/ (Perfetto UI, Holistic Trace Analysis)",
    )
    tensorboard: bool = Field(
        False,
        description="also write TensorBoard event files to OUT/tensorboard (needs the "
        "tensorboard package: pip install 'ddpcli[tensorboard]'); as --tracker tensorboard",
    )
    # experiment trackers (docs/train.md, "Tracking"): rank 0 sends them the run's rows
    tracker: TrackerList = Field(default_factory=list)
    tracking_uri: str | None = None  # MLflow's; None: MLFLOW_TRACKING_URI, else OUT/mlflow.db
    experiment: str | None = None  # None: the recipe's name, else ARCH-DATASET
    run_name: str | None = None  # None: the run folder's name
    tracker_strict: bool = Field(
        False,
        description="a tracker that cannot be reached at the start stops the run (exit 2) "
        "instead of a warning",
    )
    tracker_checkpoints: bool = Field(
        False, description="also send checkpoints/best.pt to the trackers at the end"
    )
    # From the environment: --tracker wandb without W&B credentials runs offline.
    wandb_offline: Annotated[bool, FROM_ENVIRONMENT] = False
    # The signal that saves a checkpoint at the next check (every --log-every steps) and stops
    preempt_signal: Literal["TERM", "USR1"] = "TERM"
    # debugging: each rank appends the sample indices of every training batch to PATH.rankN
    trace_samples: Annotated[Path | None, PER_NODE, FROM_ENVIRONMENT] = None
    # debugging: (rank, seconds) from DDPCLI_SLOW_DATA, a rank slowed on purpose
    slow_data: Annotated[tuple[int, float] | None, PER_NODE, FROM_ENVIRONMENT] = None
    # testing: (rank, phase, batch, step) from DDPCLI_FAKE_OOM, out-of-memory on purpose
    fake_oom: Annotated[list[tuple[int, str, int, int]], PER_NODE, FROM_ENVIRONMENT] = Field(
        default_factory=list
    )
    # Where the world came from, in words, for the run's header: a pod's variables say it
    # (build_train_config), the plan completes it (ddpcli.launcher.plan).
    world_from: Annotated[str | None, PER_NODE, FROM_ENVIRONMENT] = None

    @field_validator("init_method")
    @classmethod
    def _init_method_scheme(cls, value: str | None) -> str | None:
        if value is None or value == "env://":
            return value
        if re.fullmatch(r"tcp://[^:/\s]+:\d{1,5}", value):
            port = int(value.rsplit(":", 1)[1])
            if not 1 <= port <= 65535:
                raise ValueError(f"port {port} is out of range 1-65535")
            return value
        if re.fullmatch(r"file:///\S+", value):
            return value
        raise ValueError("use env://, tcp://HOST:PORT or file:///ABSOLUTE/PATH")

    @field_validator("dataset")
    @classmethod
    def _dataset_name(cls, value: str) -> str:
        if value in get_args(DatasetName) or is_factory_spec(value):
            return value
        raise ValueError(
            "use synthetic, stl10, imagefolder, shards, or your own data set as pkg.module:factory "
            "(docs/custom.md)"
        )

    @field_validator("model_args")
    @classmethod
    def _model_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "num_classes" in value:
            raise ValueError("num_classes comes from the data set's classes; leave it out")
        return value

    @field_validator("resume")
    @classmethod
    def _resume_value(cls, value: str | None) -> str | None:
        return None if value in (None, "", "none") else value

    @model_validator(mode="before")
    @classmethod
    def _nnodes_range(cls, data: Any) -> Any:
        return split_nnodes(data)

    @model_validator(mode="before")
    @classmethod
    def _lr_for_arch(cls, data: Any) -> Any:
        """--lr's default depends on the model and the optimiser, so it is filled in with
        the arch."""
        if isinstance(data, dict) and data.get("lr") is None and data.get("arch"):
            return {**data, "lr": default_lr(data["arch"], data.get("optimizer") or "sgd")}
        return data

    @model_validator(mode="before")
    @classmethod
    def _optimizer_defaults(cls, data: Any) -> Any:
        """--lr-scaling, --weight-decay, --momentum (SGD) and --betas (AdamW) default to the
        optimiser's values; an unknown optimiser is left for the field's own check to name."""
        if not isinstance(data, dict):
            return data
        defaults = OPTIMIZER_DEFAULTS.get(data.get("optimizer") or "sgd", {})
        missing = {key: value for key, value in defaults.items() if data.get(key) is None}
        return {**data, **missing}

    @field_validator("per_gpu_batch", mode="before")
    @classmethod
    def _batch_or_auto(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
            if value == "auto" or value >= 1:
                return value
        elif isinstance(value, str) and value.isdigit() and int(value) >= 1:
            return int(value)
        raise ValueError(
            "give a number of images of at least 1, or auto (the largest micro-batch that "
            "fits each GPU, the global batch kept)"
        )

    @field_validator("timeout")
    @classmethod
    def _timeout_floor(cls, value: float) -> float:
        if not value >= MIN_TIMEOUT_S:
            raise ValueError(
                f"at least {MIN_TIMEOUT_S:g} s: it bounds the start-up and every collective, "
                "and in less no rank can even join"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        check_node_rank(self.node_rank, self.nnodes)
        check_membership(self.min_nnodes, self.nnodes, self.rdzv_backend, self.rdzv_endpoint)
        if self.cpu and self.gpus:
            raise Excluded(
                "invalid --cpu: --cpu and --gpus exclude each other; pick one", "cpu", "gpus"
            )
        if self.dataset in ("stl10", "imagefolder", "shards") and self.data_dir is None:
            raise ValueError(f"invalid --data-dir: --dataset {self.dataset} needs --data-dir DIR")
        check_shards_settings(self)
        if is_url(self.data_dir) and self.dataset in ("stl10", "imagefolder"):
            raise Excluded(
                f"invalid --data-dir: --dataset {self.dataset} reads a folder; a URL is read as "
                "shards (pack the data with `ddpcli data pack`, upload it, --dataset shards)",
                "data_dir",
                "dataset",
            )
        if self.betas is not None and self.optimizer != "adamw":
            raise Excluded(
                "invalid --betas: they are AdamW's; add --optimizer adamw", "betas", "optimizer"
            )
        if self.momentum is not None and self.optimizer != "sgd":
            raise Excluded(
                "invalid --momentum: it is SGD's; AdamW's momentum is its --betas (drop "
                "--momentum, or use --optimizer sgd)",
                "momentum",
                "optimizer",
            )
        if self.tracking_uri is not None and "mlflow" not in self.tracker:
            raise Excluded(
                "invalid --tracking-uri: it is MLflow's store, and no --tracker mlflow sends "
                "to it; add mlflow to --tracker, or drop --tracking-uri",
                "tracking_uri",
                "tracker",
            )
        if self.reset_head and self.init_from is None:
            raise Excluded(
                "invalid --reset-head: it applies to the weights of --init-from PATH",
                "reset_head",
                "init_from",
            )
        if self.custom_dataset and self.data_path == "device":
            raise Excluded(
                "invalid --data-path: device holds the built-in sets in device memory; your own "
                "--dataset streams through the loader (--data-path loader or auto)",
                "data_path",
                "dataset",
            )
        check_decode(self.decode, self.dataset, self.data_path)
        check_dataset_settings(self)
        if self.strategy == "balanced-dp" and self.gpu0_batch is None:
            raise ValueError("invalid --gpu0-batch: --strategy balanced-dp needs --gpu0-batch N")
        if self.gpu0_batch is not None and self.strategy != "balanced-dp":
            raise Excluded(
                "invalid --gpu0-batch: it applies to --strategy balanced-dp only",
                "gpu0_batch",
                "strategy",
            )
        if self.compile and self.strategy != "ddp":
            raise Excluded(
                f"invalid --compile: it works with --strategy ddp; {self.strategy} replicates "
                "the module on every step",
                "compile",
                "strategy",
            )
        check_grad_compression(self.grad_compression, self.strategy, self.precision)
        if self.compile and self.bucket_cap_mb < 1:
            raise Excluded(
                "invalid --bucket-cap-mb: with --compile, torch's DDP optimizer needs buckets of "
                "at least 1 MB (its first bucket's size); raise it or drop --compile",
                "bucket_cap_mb",
                "compile",
            )
        check_compile_mode(self)
        check_batch_auto(self)
        if self.static_graph and self.accumulate > 1:
            raise Excluded(
                "invalid --static-graph: torch's DDP fails an internal assertion when a step "
                "accumulates under no_sync (--accumulate > 1); drop one of them",
                "static_graph",
                "accumulate",
            )
        if self.sync_bn and self.strategy != "ddp":
            raise Excluded(
                f"invalid --sync-bn: it synchronises DDP ranks; --strategy {self.strategy} is one "
                "process (use --strategy ddp)",
                "sync_bn",
                "strategy",
            )
        if self.overwrite and self.resume == "auto":
            raise Excluded(
                "invalid --overwrite: it clears --out's earlier run, and --resume auto "
                "continues it; pick one",
                "overwrite",
                "resume",
            )
        check_profile_window(self.profile_window, self.max_steps)
        return self

    # Values derived from the config, never stored twice.
    @property
    def custom_dataset(self) -> bool:
        """--dataset names the user's own factory, not a built-in set."""
        return is_factory_spec(self.dataset)

    @property
    def uses_gpus(self) -> bool:
        return not self.cpu and bool(self.gpus)

    @property
    def nproc_per_node(self) -> int:
        if self.strategy != "ddp":
            return 1
        return len(self.gpus) if self.gpus and not self.cpu else (self.nproc or 2)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def planned_global_batch(self) -> int:
        return self.global_batch_at(self.world_size)

    def global_batch_at(self, world_size: int, micro_batches_per_epoch: int | None = None) -> int:
        """Under torchrun the world comes from the launcher, not from --nproc/--gpus; an
        epoch of fewer micro-batches than --accumulate caps what one step holds."""
        if self.per_gpu_batch == "auto":  # the request, before the plan shares it out
            return self.global_batch or DEFAULT_PER_GPU_BATCH * world_size * self.accumulate
        return global_batch_of(
            self.per_gpu_batch, world_size, self.accumulate, micro_batches_per_epoch
        )

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """--profile-steps A:B as (A, B): the steps after step A up to step B are profiled."""
        if self.profile_steps is None:
            return None
        first, _, last = self.profile_steps.partition(":")
        return int(first), int(last)

    @property
    def trackers(self) -> list[str]:
        """--tracker's list, with TensorBoard when --tensorboard (its synonym) is on."""
        if self.tensorboard and "tensorboard" not in self.tracker:
            return [*self.tracker, "tensorboard"]
        return list(self.tracker)

    @property
    def data_folder(self) -> Path:
        """--data-dir as a folder, which every data set but the synthetic one and shards from
        a URL requires (`_consistent`)."""
        if not isinstance(self.data_dir, Path):
            raise RuntimeError(f"TrainConfig.data_dir read, but --dataset {self.dataset} has none")
        return self.data_dir


def check_batch_auto(cfg: TrainConfig) -> None:
    """What --per-gpu-batch auto cannot keep safe: it runs every micro-batch without a
    collective, so that a rank out of memory can still join the ranks' agreement."""
    if cfg.per_gpu_batch != "auto":
        return
    refused = {
        "strategy": cfg.strategy != "ddp" and f"--strategy {cfg.strategy} is one process",
        "sync_bn": cfg.sync_bn and "SyncBatchNorm's collectives run inside the forward pass",
        "grad_compression": cfg.grad_compression != "none"
        and "auto all-reduces the gradients itself, after the ranks agree the step fitted",
        "static_graph": cfg.static_graph and "auto runs the backward pass under no_sync",
    }
    for name, reason in refused.items():
        if reason:
            flag = name.replace("_", "-")
            raise Excluded(
                f"invalid --{flag}: not with --per-gpu-batch auto ({reason}); drop --{flag}, "
                "or give --per-gpu-batch a number",
                name,
                "per_gpu_batch",
            )


def check_decode(decode: str, dataset: str, data_path: str) -> None:
    """--decode gpu decodes the JPEGs the loader reads during training: image files, shards."""
    if decode != "gpu":
        return
    if dataset not in JPEG_DATASETS:
        raise Excluded(
            f"invalid --decode: gpu decodes the JPEGs of image folders and shards as batches "
            f"arrive; --dataset {dataset} holds none to decode (drop --decode gpu)",
            "decode",
            "dataset",
        )
    if data_path == "device":
        raise Excluded(
            "invalid --decode: --data-path device decodes the image folder once, before "
            "training; --decode gpu decodes each batch as the loader reads it; drop one",
            "decode",
            "data_path",
        )


def check_compile_mode(cfg: TrainConfig) -> None:
    """--compile-mode is torch.compile's; the graph modes refuse what a CUDA graph cannot
    hold safely (docs/train.md, "Compile and CUDA graphs"). Refused on every machine, though
    the CPU runs them without graphs: a recipe means the same wherever it runs."""
    mode = cfg.compile_mode
    if mode != "default" and not cfg.compile:
        raise Excluded(
            f"invalid --compile-mode: {mode} is a mode of torch.compile, which is off; "
            "add --compile",
            "compile_mode",
            "compile",
        )
    if not (cfg.compile and mode in CUDA_GRAPH_MODES):
        return
    refused = {
        "per_gpu_batch": cfg.per_gpu_batch == "auto"
        and (
            "auto runs micro-batches of varying sizes, each a CUDA graph of its own, and runs "
            "again a step that ran out of memory, which a capture cannot",
            "give --per-gpu-batch a number",
        ),
        "sync_bn": cfg.sync_bn
        and (
            "SyncBatchNorm's collectives would run inside the captured forward pass",
            "drop --sync-bn",
        ),
    }
    for name, refusal in refused.items():
        if refusal:
            reason, remedy = refusal
            raise Excluded(
                f"invalid --{name.replace('_', '-')}: not with --compile-mode {mode}, which "
                f"captures CUDA graphs ({reason}); {remedy}, or use --compile-mode default",
                name,
                "compile_mode",
            )


def check_grad_compression(grad_compression: str, strategy: str, precision: str) -> None:
    """The pairings --grad-compression cannot do correctly, refused with the reason."""
    if grad_compression != "none" and strategy != "ddp":
        raise Excluded(
            f"invalid --grad-compression: it compresses DDP's all-reduce; --strategy {strategy} "
            "is one process and all-reduces nothing (use --strategy ddp)",
            "grad_compression",
            "strategy",
        )
    if powersgd_rank(grad_compression) and precision == "fp16":
        raise Excluded(
            "invalid --grad-compression: PowerSGD carries each step's compression error into "
            "the next, and fp16's loss scale changes between steps (a skipped step leaves inf "
            "there); use --precision bf16 or fp32, or --grad-compression fp16",
            "grad_compression",
            "precision",
        )


def check_profile_window(window: tuple[int, int] | None, max_steps: int | None) -> None:
    """A window that --max-steps ends before it opens is refused; one that ends after the
    run's last step is said by the run (ddpcli.training.profiling), which knows that step."""
    if window is not None and max_steps is not None and window[0] >= max_steps:
        raise Excluded(
            f"invalid --profile-steps: the run stops at step {max_steps} (--max-steps), so the "
            f"steps after step {window[0]} never run; lower A or raise --max-steps",
            "profile_steps",
            "max_steps",
        )


def check_shards_settings(cfg: TrainConfig) -> None:
    """What --dataset shards cannot do: they are streamed (never held on the device), and
    each sample goes to one rank (--ra-reps shows each on several)."""
    if cfg.dataset != "shards":
        if cfg.shuffle_buffer is not None:
            raise Excluded(
                "invalid --shuffle-buffer: it shuffles the streams of --dataset shards; other "
                "data sets are permuted whole each epoch",
                "shuffle_buffer",
                "dataset",
            )
        return
    if cfg.data_path == "device":
        raise Excluded(
            "invalid --data-path: shards stream through the loader's workers (--data-path "
            "loader or auto); --data-path device holds synthetic or stl10 in device memory",
            "data_path",
            "dataset",
        )
    if cfg.ra_reps > 1:
        raise Excluded(
            "invalid --ra-reps: each sample of --dataset shards is streamed to one rank; "
            "repeated augmentation needs --dataset imagefolder",
            "ra_reps",
            "dataset",
        )


def check_recipe_types(settings: dict[str, Any], recipe: Path | None) -> None:
    """A flag's type is Typer's to check; a recipe's, as strictly, here: every setting of it,
    those a flag overrides too (the file is wrong whatever the flags beside it, and the next
    run without that flag would meet the value)."""
    batch = settings.get("per_gpu_batch")
    try:
        if isinstance(batch, str) and batch != "auto":  # the one text it takes is auto
            raise usage_error(
                f'invalid --per-gpu-batch: must be a valid integer, or "auto" (got {batch!r})'
            )
        check_strict_types(TrainConfig, settings, text_forms=("nnodes", "per_gpu_batch"))
    except DdpcliError as error:
        raise with_origins(error, dict.fromkeys(settings, f"recipe {recipe}")) from None


def check_dataset_settings(cfg: TrainConfig) -> None:
    """A setting of one data set given for another would do nothing."""
    if cfg.download and cfg.dataset != "stl10":
        raise Excluded(
            f"invalid --download: it fetches STL-10, and --dataset {cfg.dataset} is read as it "
            "is; drop --download",
            "download",
            "dataset",
        )
    if cfg.workers and cfg.data_path == "device":
        raise Excluded(
            "invalid --workers: --data-path device holds the set in device memory and "
            "augments it there, with no loader; drop --workers, or use --data-path loader",
            "workers",
            "data_path",
        )
    if cfg.skip_bad_images and cfg.dataset in ("synthetic", "stl10"):
        raise Excluded(
            "invalid --skip-bad-images: it leaves out image files that cannot be decoded, and "
            f"--dataset {cfg.dataset} has none; drop --skip-bad-images",
            "skip_bad_images",
            "dataset",
        )


def check_defaulted_settings(cfg: TrainConfig, given: dict[str, Any]) -> None:
    """Settings with a default on every config (so the field cannot tell), given where they
    would do nothing: what was given is the flags' and the recipe's word."""
    if "synthetic_size" in given and cfg.dataset != "synthetic":
        raise Excluded(
            "invalid --synthetic-size: it sizes the synthetic set, and --dataset "
            f"{cfg.dataset} is read from --data-dir; drop --synthetic-size",
            "synthetic_size",
            "dataset",
        )
    for name in ("ema_decay", "ema_steps"):
        flag = "--" + name.replace("_", "-")
        if name in given and not cfg.ema:
            raise Excluded(
                f"invalid {flag}: it tunes --ema's average of the weights, which is off; add "
                f"--ema, or drop {flag}",
                name,
                "ema",
            )
    check_powersgd_start_step(cfg, given)


def check_powersgd_start_step(cfg: TrainConfig, given: dict[str, Any]) -> None:
    """--powersgd-start-step only delays PowerSGD: given for another compression it would do
    nothing, as --momentum would with AdamW. (Its default of 1000 is on every config, so
    what was given is the flags' and the recipe's word, not the field.)"""
    if "powersgd_start_step" in given and powersgd_rank(cfg.grad_compression) is None:
        raise Excluded(
            "invalid --powersgd-start-step: it delays PowerSGD, and --grad-compression is "
            f"{cfg.grad_compression}; add --grad-compression powersgd (or powersgd:RANK), or "
            "drop --powersgd-start-step",
            "powersgd_start_step",
            "grad_compression",
        )


def load_recipe(path: Path) -> dict[str, Any]:
    """A recipe is a TOML file of flag names (`per_gpu_batch = 32` or `per-gpu-batch = 32`),
    at the top level or under a `[train]` table. Beside a `[train]` table nothing else may
    stand (it would be ignored), and each setting is given once, in either spelling."""
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise usage_error(
            f"invalid --recipe: {path} does not exist; see recipes/ for examples"
        ) from None
    except IsADirectoryError:
        raise usage_error(f"invalid --recipe: {path} is a folder; give a TOML file") from None
    except UnicodeDecodeError:
        raise usage_error(
            f"invalid --recipe: {path} is not a text file (a recipe is TOML, in UTF-8); "
            "see recipes/ for examples"
        ) from None
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise usage_error(f"invalid --recipe: {path} is not readable TOML: {error}") from None
    if "train" not in data:
        return recipe_settings(data, path)
    outside = [key for key in data if key != "train"]
    if outside:
        raise usage_error(
            f"invalid --recipe: {path} sets {', '.join(outside)} outside its [train] table, "
            "where it would be ignored; move it under [train]"
        )
    if not isinstance(data["train"], dict):
        raise usage_error(f"invalid --recipe: {path}: [train] must be a table of settings")
    return recipe_settings(data["train"], path)


def recipe_settings(table: dict[str, Any], path: Path) -> dict[str, Any]:
    """Field name -> value; one setting given in both spellings is refused, not resolved."""
    settings: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name in settings:
            raise usage_error(
                f"invalid --recipe: {path} sets {name} twice ({spelled[name]} and {key}); keep one"
            )
        settings[name], spelled[name] = value, key
    return settings


def setting_origins(
    kept: dict[str, Any], from_flags: dict[str, Any], recipe: Path | None
) -> dict[str, str]:
    """Field name -> where the value in effect came from, in words, the recipe's KEPT
    settings and the flags'; {} without a recipe (every setting then comes from the command
    line)."""
    if recipe is None:
        return {}
    origins = dict.fromkeys(kept, f"recipe {recipe}")
    origins.update(dict.fromkeys(from_flags, "the command line"))
    return origins


def parse_fake_oom(text: str) -> list[tuple[int, str, int, int]]:
    """DDPCLI_FAKE_OOM's RANK:PHASE:BATCH[:STEP] entries, comma-separated."""
    parsed = []
    for entry in text.split(","):
        fields = entry.strip().split(":")
        ok = len(fields) in (3, 4) and fields[1] in OOM_PHASES
        ok = ok and all(field.isdigit() for field in fields[:1] + fields[2:])
        if not ok or int(fields[2]) < 1:
            raise usage_error(
                f"invalid {FAKE_OOM_VARIABLE}: give RANK:PHASE:BATCH[:STEP], PHASE one of "
                f"{', '.join(OOM_PHASES)}, e.g. 1:backward:32:5 (got {entry!r})"
            )
        step = int(fields[3]) if len(fields) == 4 else 0
        parsed.append((int(fields[0]), fields[1], int(fields[2]), step))
    return parsed


def parse_slow_data(text: str) -> tuple[int, float]:
    rank, _, seconds = text.partition(":")
    try:
        parsed = int(rank), float(seconds)
    except ValueError:
        parsed = (-1, -1.0)
    if parsed[0] < 0 or not 0 <= parsed[1] <= 60:
        raise usage_error(
            f"invalid {SLOW_DATA_VARIABLE}: give RANK:SECONDS, e.g. 1:0.05 (got {text!r})"
        )
    return parsed


# ddpcli.data.shards.index.INDEX_NAME: what `ddpcli data pack` writes beside its shards.
SHARD_INDEX_NAME = "index.json"


def holds_shard_index(data_dir: Any) -> bool:
    """--data-dir is a folder of packed shards, or a URL (only shards are read from one):
    --dataset shards unless another is named."""
    if data_dir is None or is_url(data_dir):
        return data_dir is not None
    return (Path(data_dir) / SHARD_INDEX_NAME).is_file()


def dataset_in(data_dir: Any, download: bool) -> str:
    """The data set a --data-dir given without --dataset holds: shards (index.json), STL-10
    (stl10_binary/, or to be fetched there by --download) or an image folder (train/ or
    val/). Exit 2 where it holds none of them: the synthetic default would ignore it."""
    if holds_shard_index(data_dir):
        return "shards"
    folder = Path(data_dir)
    # stl10_binary itself: STL-10's check then says to name the folder holding it.
    if download or folder.name == "stl10_binary" or (folder / "stl10_binary").is_dir():
        return "stl10"
    if (folder / "train").is_dir() or (folder / "val").is_dir():
        return "imagefolder"
    if not folder.is_dir():
        raise usage_error(f"invalid --data-dir: {data_dir} does not exist or is not a folder")
    raise usage_error(
        f"invalid --data-dir: {data_dir} holds no data set (shards' {SHARD_INDEX_NAME}, "
        "stl10_binary/, or train/ and val/ class folders); name one with --dataset, or drop "
        "--data-dir to train on the synthetic set"
    )


@dataclass(frozen=True)
class SettledRequest:
    """`ddpcli train`'s request, where each given setting came from (for errors found
    later), and a line for each recipe setting a flag left out, naming that flag."""

    config: TrainConfig
    origins: dict[str, str]
    left_out: list[str]


def spelled(name: str, value: Any) -> str:
    """A setting as its flag writes it: `--optimizer adamw`, `--compile`, `--no-ema`."""
    flag = FLAG_SPELLINGS.get(name, f"--{name.replace('_', '-')}")
    if isinstance(value, bool):
        return flag if value else f"--no-{flag.removeprefix('--')}"
    shown = ",".join(map(str, value)) if isinstance(value, list) else value
    return f"{flag} {shown}"


def build_train_config(
    flags: dict[str, Any], recipe: Path | None, environ: Mapping[str, str] | None = None
) -> TrainConfig:
    """Defaults < recipe < flags; flags left at None mean "not given"."""
    return settle_train_request(flags, recipe, environ).config


def settle_train_request(
    flags: dict[str, Any], recipe: Path | None, environ: Mapping[str, str] | None = None
) -> SettledRequest:
    """The request from the defaults, RECIPE and FLAGS. A flag always wins: where the flags
    set one side of an exclusion and the recipe the other, the recipe's side is left out
    and the request built again (each exclusion is stated once, as its refusal)."""
    env = os.environ if environ is None else environ
    from_pod, pod_origins = pod_defaults(env, train_nproc_settings)
    from_recipe = load_recipe(recipe) if recipe else {}
    from_flags = given(flags)
    refuse_resolved(RunFacts, {**from_recipe, **from_flags}, from_recipe, recipe)
    check_recipe_types(from_recipe, recipe)
    kept = dict(from_recipe)
    left_out: list[str] = []
    while True:
        try:
            config = request_from(from_pod, kept, from_flags, env, recipe)
            return SettledRequest(config, setting_origins(kept, from_flags, recipe), left_out)
        except (ValidationError, Excluded) as error:
            overruled = recipe_side(exclusion_in(error), kept, from_flags)
            if overruled is None:
                given_here = {**from_recipe, **from_flags}
                origins = {k: v for k, v in pod_origins.items() if k not in given_here}
                origins.update(setting_origins(kept, from_flags, recipe))
                raise with_origins(refusal_of(error), origins) from None
            setting, flag = overruled
            left_out.append(
                f"recipe {recipe}: {spelled(setting, kept.pop(setting))} left out, as "
                f"{spelled(flag, from_flags[flag])} on the command line excludes it"
            )


def refusal_of(error: ValidationError | Excluded) -> DdpcliError:
    """Exit 2 with the refusal's own line(s), naming the flags."""
    if isinstance(error, Excluded):
        return usage_error(str(error))
    return usage_error(describe_validation_error(error))


def recipe_side(
    exclusion: Excluded | None, kept: dict[str, Any], from_flags: dict[str, Any]
) -> tuple[str, str] | None:
    """(the setting of EXCLUSION that the recipe gives, among KEPT; the flag's setting that
    overrules it by giving the other side), or None where the refusal stands."""
    if exclusion is None:
        return None
    first, second = exclusion.first, exclusion.second
    for flagged, other in ((first, second), (second, first)):
        if flagged in from_flags and other in kept and other not in from_flags:
            return other, flagged
    return None


def request_from(
    from_pod: dict[str, Any],
    kept: dict[str, Any],
    from_flags: dict[str, Any],
    env: Mapping[str, str],
    recipe: Path | None,
) -> TrainConfig:
    """The request from the pod's defaults, the recipe's KEPT settings and the flags; a
    refusal comes as pydantic's error or an Excluded."""
    values = {**from_pod, **kept, **from_flags}
    if "dataset" not in values and values.get("data_dir") is not None:
        values["dataset"] = dataset_in(values["data_dir"], bool(values.get("download")))
    if env.get(TRACE_SAMPLES_VARIABLE):
        values.setdefault("trace_samples", Path(env[TRACE_SAMPLES_VARIABLE]))
    if pod := pet_variables(env):
        values["world_from"] = describe_pod(pod)
    if env.get(SLOW_DATA_VARIABLE):
        values.setdefault("slow_data", parse_slow_data(env[SLOW_DATA_VARIABLE]))
    if env.get(FAKE_OOM_VARIABLE):
        values.setdefault("fake_oom", parse_fake_oom(env[FAKE_OOM_VARIABLE]))
    tracking_defaults(values, recipe, env)
    cfg = TrainConfig(**values)
    check_defaulted_settings(cfg, values)
    return cfg


def tracking_defaults(values: dict[str, Any], recipe: Path | None, env: Mapping[str, str]) -> None:
    """MLflow's own variable for its store, the recipe's name for the experiment, and W&B
    offline where no credentials are set (it would stop to ask for them)."""
    # MLflow's variable may be set for other tools: only a run that asks for MLflow takes it.
    if env.get("MLFLOW_TRACKING_URI") and "mlflow" in str(values.get("tracker", "")):
        values.setdefault("tracking_uri", env["MLFLOW_TRACKING_URI"])
    if recipe is not None:
        values.setdefault("experiment", recipe.stem)
    if "wandb" in str(values.get("tracker", "")):
        values["wandb_offline"] = not has_wandb_credentials(env)


def has_wandb_credentials(env: Mapping[str, str]) -> bool:
    """WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc; WANDB_MODE=offline says no."""
    if env.get("WANDB_MODE") in ("offline", "dryrun", "disabled"):
        return False
    if env.get("WANDB_API_KEY"):
        return True
    netrc = Path(env.get("NETRC") or Path.home() / ".netrc")
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def train_nproc_settings(text: str) -> dict[str, Any]:
    """PET_NPROC_PER_NODE for `ddpcli train`: N processes (one per GPU on a GPU pod, which
    Kubeflow gives N GPUs), cpu: one per core on the CPU, auto/gpu: ddpcli's default (every
    GPU, else 2 CPU processes; torchrun's auto would start one per core on a CPU pod)."""
    spec = nproc_spec(text)
    if isinstance(spec, int):
        return {"nproc": spec}
    if spec == "cpu":
        return {"cpu": True, "nproc": os.cpu_count() or 1}
    return {}
