"""What check-env knows about this node, read once: software versions, GPUs (as nvidia-smi
numbers them, and as a process numbers them given CUDA_VISIBLE_DEVICES), the distributed
variables that are set, the network (ddpcli.network), and where the master is.
Torch is imported inside the functions that ask it, never at module level."""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass

from ddpcli.config.checkenv import CheckEnvOptions, is_loopback
from ddpcli.environments.pods import PET_FLAGS
from ddpcli.machine import nvidia_driver_version, run_tool
from ddpcli.network import Interface, list_interfaces, resolve_ip, route_to

SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
DISTRIBUTED_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG",
    "TORCH_DISTRIBUTED_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
    "OMP_NUM_THREADS", "DDPCLI_PROBE_TAG",
    # SLURM's view of the job: what read_launcher_env turns into ranks
    "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_NNODES", "SLURM_NODEID",
    "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_PROCID", "SLURM_LOCALID",
    "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS",
    # A Kubeflow pod: torchrun's flag defaults, which `ddpcli train` and `launch` read too
    *PET_FLAGS, "TORCHELASTIC_RUN_ID",
)  # fmt: skip
# Settings that must agree between nodes; interface names legitimately differ per node.
COMPARED_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")
PROBE_TAG_VARIABLE = "DDPCLI_PROBE_TAG"  # a label (image digest, release) every node must share


@dataclass
class Gpu:
    index: int | None  # physical, as nvidia-smi numbers it; None when only torch could tell
    name: str
    memory_mib: int
    uuid: str = ""
    cuda_index: int | None = None  # its number inside a process, given CUDA_VISIBLE_DEVICES


@dataclass
class NodeFacts:
    host: str
    host_address: str | None  # what the host name resolves to; Gloo advertises it by default
    versions: dict[str, str]
    backends: dict[str, bool]
    cuda_available: bool
    gpus: list[Gpu]
    physical_known: bool  # gpus come from nvidia-smi (physical numbering)
    visible_gpus: int  # what torch sees in this process
    cuda_visible_devices: str | None
    invalid_visible_entries: list[str]
    interfaces: list[Interface]
    environment: dict[str, str]

    def interface(self, name: str) -> Interface | None:
        return next((iface for iface in self.interfaces if iface.name == name), None)

    def holder_of(self, ip: str) -> Interface | None:
        return next((iface for iface in self.interfaces if ip in iface.ips), None)


def collect_facts() -> NodeFacts:
    import torch

    physical = nvidia_smi_gpus()
    visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    cuda_available = torch.cuda.is_available()
    visible = torch.cuda.device_count() if cuda_available else 0
    invalid: list[str] = []
    if physical is not None:
        gpus = physical
        invalid = map_visible_devices(gpus, visible_devices)
    else:
        gpus = torch_visible_gpus() if cuda_available else []
    host = socket.gethostname()
    return NodeFacts(
        host=host,
        host_address=resolve_ip(host),
        versions=software_versions(),
        backends=backend_availability(),
        cuda_available=cuda_available,
        gpus=gpus,
        physical_known=physical is not None,
        visible_gpus=visible,
        cuda_visible_devices=visible_devices,
        invalid_visible_entries=invalid,
        interfaces=list_interfaces(),
        environment=distributed_environment(),
    )


def software_versions(with_driver: bool = True) -> dict[str, str]:
    import torch

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "cudnn": "",
        "nccl": "",
        "driver": (nvidia_driver_version() or "") if with_driver else "",
    }
    if torch.backends.cudnn.is_available():
        versions["cudnn"] = cudnn_version_text(torch.backends.cudnn.version())
    try:
        import torch.cuda.nccl

        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # a CPU-only build has no NCCL to ask
        pass
    return versions


def cudnn_version_text(number: int | None) -> str:
    if not number:
        return ""
    # cuDNN 9 encodes major*10000 + minor*100 + patch; cuDNN 8 encoded major*1000 + ...
    major_unit = 10000 if number >= 90000 else 1000
    return f"{number // major_unit}.{number % major_unit // 100}.{number % 100}"


def backend_availability() -> dict[str, bool]:
    import torch.distributed as dist

    if not dist.is_available():
        return {"gloo": False, "nccl": False, "mpi": False}
    return {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }


def nvidia_smi_gpus() -> list[Gpu] | None:
    """Every GPU as nvidia-smi numbers it, regardless of CUDA_VISIBLE_DEVICES."""
    listing = run_tool(
        [
            "nvidia-smi",
            "--query-gpu=index,name,memory.total,uuid",
            "--format=csv,noheader,nounits",
        ]
    )
    if listing is None:
        return None
    gpus = []
    for line in listing.strip().splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            memory = int(parts[2]) if parts[2].isdigit() else 0
            gpus.append(Gpu(int(parts[0]), parts[1], memory, parts[3]))
    return gpus


def torch_visible_gpus() -> list[Gpu]:
    import torch

    gpus = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        gpus.append(Gpu(None, properties.name, properties.total_memory // 2**20, cuda_index=index))
    return gpus


def map_visible_devices(gpus: list[Gpu], visible_devices: str | None) -> list[str]:
    """Fill each GPU's index inside a process; return the entries that name no GPU."""
    if visible_devices is None:
        for gpu in gpus:
            gpu.cuda_index = gpu.index
        return []
    entries = [entry.strip() for entry in visible_devices.split(",") if entry.strip()]
    if any(entry.startswith("MIG-") for entry in entries):
        return []  # MIG slices are not whole GPUs: there is no per-GPU numbering to show
    for position, entry in enumerate(entries):
        named = next((gpu for gpu in gpus if visible_entry_names(entry, gpu)), None)
        if named is None or named.cuda_index is not None:
            # CUDA stops at the first entry it cannot use: this one and all after it are lost.
            return entries[position:]
        named.cuda_index = position
    return []


def visible_entry_names(entry: str, gpu: Gpu) -> bool:
    if entry.isdigit():
        return int(entry) == gpu.index
    return bool(gpu.uuid) and gpu.uuid.startswith(entry)


def distributed_environment() -> dict[str, str]:
    names = set(DISTRIBUTED_VARIABLES)
    names.update(name for name in os.environ if name.startswith("NCCL_"))
    return {name: os.environ[name] for name in sorted(names) if name in os.environ}


def comparable_settings() -> dict[str, str]:
    """The variables that must agree between nodes (interface names may differ)."""
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if name.startswith(COMPARED_PREFIXES) and not name.endswith("_SOCKET_IFNAME")
    }


def comparable_facts(versions: dict[str, str]) -> dict:
    """What every node (and rank) reports for the probe to compare."""
    keys = ("python", "torch", "cuda", "cudnn", "nccl")
    return {
        **{key: versions.get(key, "") for key in keys},
        "tag": os.environ.get(PROBE_TAG_VARIABLE, ""),
        "settings": comparable_settings(),
    }


# --- The master ------------------------------------------------------------------------------


@dataclass
class Master:
    addr: str
    port: int
    ip: str | None  # None: the name does not resolve
    this_node: bool  # the address is one of this node's (or loopback)
    interface: str | None  # where this node's traffic to the master goes

    @property
    def loopback(self) -> bool:
        return self.ip is not None and is_loopback(self.ip)


def locate_master(options: CheckEnvOptions, facts: NodeFacts) -> Master:
    ip = resolve_ip(options.master_addr)
    holder = facts.holder_of(ip) if ip else None
    this_node = holder is not None or (ip is not None and is_loopback(ip))
    interface: str | None
    if holder is not None:
        # The route to one's own address always says "lo"; the master listens on the holder.
        interface = holder.name
    else:
        route = route_to(ip) if ip else None
        interface = route.dev if route else None
    return Master(options.master_addr, options.master_port, ip, this_node, interface)


def hosts_master(options: CheckEnvOptions, master: Master) -> bool:
    """Is this node the one whose rank 0 listens on the master port?"""
    return options.node_rank == 0 if options.multi_node else master.this_node
