"""Facts about this machine that a launch is checked against: CPU cores, GPUs as nvidia-smi
numbers them, network interfaces. Torch is imported only when nvidia-smi is not there."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

from ddpcli.errors import usage_error

NVIDIA_SMI_TIMEOUT_S = 20


def cpu_count() -> int:
    """Cores this process may run on (a scheduler's affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def physical_gpu_count() -> int:
    """GPUs as nvidia-smi numbers them, regardless of CUDA_VISIBLE_DEVICES, without
    creating a CUDA context in this (launcher) process."""
    if shutil.which("nvidia-smi"):
        try:
            listing = subprocess.run(
                ["nvidia-smi", "-L"],
                capture_output=True,
                text=True,
                timeout=NVIDIA_SMI_TIMEOUT_S,
                check=True,
            ).stdout
            return sum(1 for line in listing.splitlines() if line.startswith("GPU "))
        except (subprocess.SubprocessError, OSError):
            pass
    import torch

    return torch.cuda.device_count() if "CUDA_VISIBLE_DEVICES" not in os.environ else 0


def check_gpu_indices(indices: list[int] | None, cpu_alternative: str) -> None:
    """Every listed GPU exists; else exit 2 naming the first that does not.
    `cpu_alternative` is the flag that runs the same command without GPUs."""
    if not indices:
        return
    count = physical_gpu_count()
    missing = [index for index in indices if index >= count]
    if missing:
        have = f"GPUs 0..{count - 1}" if count else "no GPU"
        raise usage_error(
            f"invalid --gpus: GPU {missing[0]} does not exist (this machine has {have}); "
            f"list indices as nvidia-smi shows them, or use {cpu_alternative}"
        )


def network_interfaces() -> list[str]:
    return sorted(name for _, name in socket.if_nameindex())


def check_interface(name: str) -> None:
    names = network_interfaces()
    if name not in names:
        raise usage_error(
            f"invalid --ifname: interface {name!r} does not exist; this machine has: "
            f"{', '.join(names)}"
        )


TOOL_TIMEOUT_S = 5.0  # nvidia-smi, ip, ss: a stuck tool must not make a check hang


def run_tool(argv: list[str], timeout_s: float = TOOL_TIMEOUT_S) -> str | None:
    """A system tool's output, or None when it is missing, fails or takes too long."""
    if not shutil.which(argv[0]):
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except (subprocess.SubprocessError, OSError):
        return None
    return done.stdout if done.returncode == 0 else None
