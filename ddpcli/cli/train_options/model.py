"""`ddpcli train`'s Model and optimisation panel: the network, its starting weights, and how
the optimizer steps (batch, learning rate and its scaling, schedule, precision)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from ddpcli.cli.options import option
from ddpcli.cli.train_options import train_option
from ddpcli.config.train import ADAMW_LR, BUILTIN_NET_LR, OPTIMIZER_DEFAULTS, REFERENCE_LR
from ddpcli.models.archs import BUILTIN_ARCHS

PANEL = "Model and optimisation"
SGD, ADAMW = OPTIMIZER_DEFAULTS["sgd"], OPTIMIZER_DEFAULTS["adamw"]

Arch = Annotated[
    str | None,
    train_option(
        "arch",
        f"torchvision model name, {'/'.join(BUILTIN_ARCHS)}, timm:NAME (needs timm), or your own "
        "model: pkg.module:factory, pkg.module.factory or path/to/file.py:factory, called "
        "with num_classes= and the --model-arg keywords (docs/custom.md).",
        PANEL,
        default="resnet18 on GPUs, smallcnn on the CPU",
    ),
]

ModelArgs = Annotated[
    list[str] | None,
    option(
        "KEY=VALUE passed to the model's constructor; VALUE is read as TOML (4, 0.5, "
        "true, [1,2]), else as a string. Repeatable.",
        panel=PANEL,
        default="none",
        metavar="KEY=VALUE",
        decls=("--model-arg",),
    ),
]

InitFrom = Annotated[
    Path | None,
    train_option(
        "init_from",
        "Start from these weights: a ddpcli checkpoint, a `ddpcli checkpoint convert` "
        "output or a torch.save'd state dict. Not a resume: step, optimiser and schedule "
        "start fresh.",
        PANEL,
        default="none: the model's own initialisation",
    ),
]

ResetHead = Annotated[bool | None, train_option("reset_head", panel=PANEL)]

Epochs = Annotated[int | None, train_option("epochs", panel=PANEL)]

PerGpuBatch = Annotated[
    str | None,
    train_option(
        "per_gpu_batch",
        "Batch of one process, or auto: the largest micro-batch that fits each GPU, searched "
        "before the first step and lowered on every rank together if a step runs out of "
        "memory, the global batch kept.",
        PANEL,
        metavar="N|auto",
    ),
]

GlobalBatch = Annotated[
    int | None,
    train_option(
        "global_batch",
        "Images per optimizer step over every rank: --accumulate follows from it (with "
        "--per-gpu-batch auto, each process's share).",
        PANEL,
        default="per-gpu-batch x world x accumulate",
    ),
]

Accumulate = Annotated[
    int | None, train_option("accumulate", "Micro-batches per optimizer step.", PANEL)
]

Lr = Annotated[
    float | None,
    train_option(
        "lr",
        "Peak learning rate for a global batch of --lr-base-batch images.",
        PANEL,
        default=f"sgd {REFERENCE_LR:g} ({BUILTIN_NET_LR:g} for {'/'.join(BUILTIN_ARCHS)}); "
        f"adamw {ADAMW_LR}",
    ),
]

LrBaseBatch = Annotated[
    int | None, train_option("lr_base_batch", "The global batch --lr is meant for.", PANEL)
]

LrScaling = Annotated[
    str | None,
    train_option(
        "lr_scaling",
        "How --lr follows the global batch (per-gpu-batch x world x accumulate): linear "
        "multiplies it by global/base, sqrt by the square root of that; none: --lr as given.",
        PANEL,
        default=f"{SGD['lr_scaling']} for sgd, {ADAMW['lr_scaling']} for adamw",
    ),
]

Optimizer = Annotated[
    str | None,
    train_option(
        "optimizer",
        "sgd: Nesterov momentum; adamw: decoupled weight decay. Each brings its own "
        "--lr, --lr-scaling and --weight-decay defaults.",
        PANEL,
    ),
]

Momentum = Annotated[
    float | None, train_option("momentum", "SGD's.", PANEL, default=f"{SGD['momentum']} with sgd")
]

Betas = Annotated[
    str | None,
    train_option(
        "betas",
        "AdamW's, as B1,B2.",
        PANEL,
        default=f"{','.join(map(str, ADAMW['betas']))} with adamw",
    ),
]

WeightDecay = Annotated[
    float | None,
    train_option(
        "weight_decay",
        "Not on norms and biases.",
        PANEL,
        default=f"{SGD['weight_decay']} sgd, {ADAMW['weight_decay']} adamw",
    ),
]

WarmupEpochs = Annotated[float | None, train_option("warmup_epochs", panel=PANEL)]

LabelSmoothing = Annotated[float | None, train_option("label_smoothing", panel=PANEL)]

Seed = Annotated[int | None, train_option("seed", panel=PANEL)]

Precision = Annotated[
    str | None,
    train_option(
        "precision",
        "auto: bf16 on GPUs that have it, and on CPUs with native bf16 (AVX512_BF16, "
        "AMX) for models of dense convolutions and matmuls; else fp32. The header says why.",
        PANEL,
    ),
]

Compile = Annotated[bool | None, train_option("compile", "torch.compile the model.", PANEL)]

CompileMode = Annotated[
    str | None,
    train_option(
        "compile_mode",
        "torch.compile's mode with --compile: reduce-overhead captures CUDA graphs of the "
        "step (on GPUs); max-autotune also tunes kernels.",
        PANEL,
    ),
]

MaxSteps = Annotated[
    int | None,
    train_option("max_steps", "Stop after N optimizer steps.", PANEL, default="no limit"),
]
