"""Before a launch: will the run fit this machine? More processes than cores, or an estimate
of host memory beyond what is available, is a warning with its arithmetic, not a refusal:
the figures are estimates, and an oversubscribed run still works, slowly."""

from __future__ import annotations

from pathlib import Path

from ddpcli.config.plan import RunPlan
from ddpcli.machine import cpu_count

GB = 1e9
# A training process's own footprint before any data or model: the interpreter, torch and
# its libraries, a Gloo group (docs/performance.md: peak RSS per rank).
PROCESS_BASE_BYTES = 0.45 * GB
# Weights, gradients, optimizer state and DDP's gradient buckets: four float32 copies.
MODEL_COPIES = 4
STL10_IMAGES = 13_000  # train + test split


def capacity_warnings(cfg: RunPlan, available_bytes: float | None = None) -> list[str]:
    """What this node's share of the run asks of the machine, where it asks too much."""
    warnings = []
    processes, cores = cfg.nproc_per_node, cpu_count()
    if processes > cores:
        warnings.append(
            f"{processes} processes on {cores} core(s): each gets about {cores / processes:.0%} "
            f"of a core ({cores} / {processes}), and every collective waits for the slowest; "
            f"--nproc {cores} or fewer trains faster"
        )
    available = available_memory_bytes() if available_bytes is None else available_bytes
    if available is None:
        return warnings
    data, model = data_bytes(cfg), model_bytes(cfg)
    per_process = PROCESS_BASE_BYTES + data + model
    if processes * per_process > available:
        warnings.append(
            f"this run needs about {processes * per_process / GB:.1f} GB of host memory "
            f"({processes} processes x {per_process / GB:.2f} GB: {PROCESS_BASE_BYTES / GB:.2f} "
            f"torch and its libraries + {data / GB:.2f} data set + {model / GB:.2f} model and "
            f"optimizer), but {available / GB:.1f} GB is available: it may be killed out of "
            "memory; lower --nproc"
        )
    return warnings


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    """MemAvailable: what can be used without swapping (Linux); None where unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def data_bytes(cfg: RunPlan) -> float:
    """Each CPU process holds the uint8 set in its memory (the device path on the CPU);
    on GPUs, and for image folders, the set is elsewhere or streamed."""
    if cfg.uses_gpus or cfg.dataset in ("imagefolder", "shards") or cfg.data_path == "loader":
        return 0.0
    images = cfg.synthetic_size * 1.25 if cfg.dataset == "synthetic" else STL10_IMAGES
    return images * 3 * cfg.image_size**2


def model_bytes(cfg: RunPlan) -> float:
    """The model's float32 copies in host memory (on GPUs they are in device memory),
    counted on the meta device: no memory, no weights."""
    if cfg.uses_gpus:
        return 0.0
    import torch

    from ddpcli.models.build import build_model

    classes = 1000 if cfg.dataset == "imagefolder" else 10
    with torch.device("meta"):
        model = build_model(cfg.arch, classes)
    return MODEL_COPIES * 4.0 * sum(parameter.numel() for parameter in model.parameters())
