"""`ddpcli train`'s Processes and devices panel: how many ranks, on which devices, wrapped how."""

from __future__ import annotations

from typing import Annotated

from ddpcli.cli.train_options import train_option
from ddpcli.config.train import POWERSGD_DEFAULT_RANK

PANEL = "Processes and devices"

Gpus = Annotated[
    str | None,
    train_option(
        "gpus",
        "Physical GPU indices, one process each: 0,3.",
        PANEL,
        default="all GPUs, else 2 CPU processes",
    ),
]

Cpu = Annotated[bool | None, train_option("cpu", "Gloo processes on the CPU.", PANEL)]

Nproc = Annotated[
    int | None,
    train_option("nproc", "Processes per node on the CPU.", PANEL, default="2"),
]

Backend = Annotated[
    str | None, train_option("backend", "auto: nccl on GPUs, gloo on the CPU.", PANEL)
]

Strategy = Annotated[
    str | None,
    train_option(
        "strategy", "ddp: one process per device; dp, balanced-dp: nn.DataParallel.", PANEL
    ),
]

Gpu0Batch = Annotated[
    int | None,
    train_option(
        "gpu0_batch",
        "balanced-dp: GPU 0's share of each --per-gpu-batch batch (2 of 8 on three GPUs: 2+3+3).",
        PANEL,
        default="none",
    ),
]

BucketCapMb = Annotated[float | None, train_option("bucket_cap_mb", panel=PANEL)]

FindUnusedParameters = Annotated[bool | None, train_option("find_unused_parameters", panel=PANEL)]

StaticGraph = Annotated[bool | None, train_option("static_graph", panel=PANEL)]

FlightRecorder = Annotated[bool | None, train_option("flight_recorder", panel=PANEL)]

GradientAsBucketView = Annotated[bool | None, train_option("gradient_as_bucket_view", panel=PANEL)]

GradCompression = Annotated[
    str | None,
    train_option(
        "grad_compression",
        "What DDP all-reduces: fp32 gradients (none), fp16 or bf16 casts (half the bytes), or "
        f"PowerSGD's rank-RANK factors with error feedback (powersgd: rank "
        f"{POWERSGD_DEFAULT_RANK}).",
        PANEL,
        metavar="none|fp16|bf16|powersgd[:RANK]",
    ),
]

PowersgdStartStep = Annotated[int | None, train_option("powersgd_start_step", panel=PANEL)]
