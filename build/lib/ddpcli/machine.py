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


def nvidia_smi_listing() -> list[str] | None:
    """`nvidia-smi -L`'s GPU lines ("GPU 0: NVIDIA H100 (UUID: GPU-...)"), in its (PCI bus)
    order; None when nvidia-smi is missing or fails."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    return [line for line in listing.splitlines() if line.startswith("GPU ")]


def nvidia_driver_version() -> str | None:
    """The NVIDIA driver's version ("535.104.05"), from nvidia-smi's query; None without it."""
    listing = run_tool(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return listing.splitlines()[0].strip() if listing and listing.strip() else None


# Where a GPU driver shows itself: NVIDIA's kernel module, WSL's GPU, AMD's ROCm (whose
# GPUs torch.cuda also counts).
GPU_DRIVER_TRACES = ("/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")


def physical_gpu_count() -> int:
    """GPUs as nvidia-smi numbers them, regardless of CUDA_VISIBLE_DEVICES, without
    creating a CUDA context in this (launcher) process."""
    listing = nvidia_smi_listing()
    if listing is not None:
        return len(listing)
    if not any(os.path.exists(trace) for trace in GPU_DRIVER_TRACES):
        return 0  # no GPU driver at all: said without loading torch (seconds) to ask CUDA
    import torch

    return torch.cuda.device_count() if "CUDA_VISIBLE_DEVICES" not in os.environ else 0


def granted_gpus(count: int) -> list[int] | None:
    """The GPUs CUDA_VISIBLE_DEVICES grants this shell (a user's choice, or a scheduler's
    without device cgroups), as nvidia-smi indices; None when it is unset. Its entries are
    read in nvidia-smi's order, the CUDA_DEVICE_ORDER=PCI_BUS_ID our workers run with.
    `count`: the GPUs nvidia-smi lists; an entry beyond them is refused."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    entries = [entry.strip() for entry in value.split(",") if entry.strip()]
    granted: list[int] = []
    for entry in entries:
        if entry.startswith("-"):  # CUDA stops at a negative entry: "-1" hides every GPU
            break
        index = gpu_index_of(entry, value)
        if index >= count:
            raise usage_error(
                f"CUDA_VISIBLE_DEVICES={value} names GPU {index}, which does not exist (this "
                f"machine has GPUs 0..{count - 1}); list indices as nvidia-smi shows them"
            )
        if index in granted:
            raise usage_error(f"CUDA_VISIBLE_DEVICES={value} names GPU {index} twice; list it once")
        granted.append(index)
    return granted


def gpu_index_of(entry: str, value: str) -> int:
    """One CUDA_VISIBLE_DEVICES entry (an index or a GPU UUID) as an nvidia-smi index."""
    if entry.isdigit():
        return int(entry)
    if entry.startswith("GPU-"):
        for line in nvidia_smi_listing() or []:
            if f"(UUID: {entry}" in line:
                return int(line.split(":", 1)[0].removeprefix("GPU "))
    raise usage_error(
        f"CUDA_VISIBLE_DEVICES={value}: {entry!r} is not a GPU index or UUID that nvidia-smi "
        "lists here (MIG slices are not supported); unset it, or list whole GPUs: 0,1"
    )


def check_gpu_indices(indices: list[int] | None, cpu_alternative: str) -> None:
    """Every listed GPU exists, and is one CUDA_VISIBLE_DEVICES grants when it is set; else
    exit 2 naming the first that is not. `cpu_alternative` is the flag that runs the same
    command without GPUs."""
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
    granted = granted_gpus(count)
    refused = [index for index in indices if granted is not None and index not in granted]
    if refused:
        shares = ",".join(map(str, granted or [])) or "none"
        raise usage_error(
            f"invalid --gpus: GPU {refused[0]} is not one that CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')} grants this shell (GPUs {shares}, "
            "as nvidia-smi numbers them); list among those, or leave --gpus out to use them all"
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
