"""The checks behind `ddpcli check-env`: what a person runs on every node before a
multi-GPU or multi-node job, so that the job does not hang at init.

`collect_facts()` reads this node once (torch, nvidia-smi, `ip`, the environment); every
check is then a plain function of those facts and the options that returns rows of
(name, status, detail, fix). `--probe` adds the rows of a real collective (ddpcli.probe).
Nothing here imports torch at module level, so the CLI stays quick to load.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ddpcli.config import Backend, describe_validation_error
from ddpcli.errors import usage_error
from ddpcli.machine import check_interface, network_interfaces

OK, WARN, FAIL = "ok", "warn", "fail"
DEFAULT_MASTER_PORT = 29500  # torchrun's default: the port a run uses unless told otherwise
TOOL_TIMEOUT_S = 5.0  # nvidia-smi, ip, ss: a stuck tool must not make check-env hang
CONNECT_TIMEOUT_S = 3.0
RESOLVE_TIMEOUT_S = 3.0
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
)  # fmt: skip
# Settings that must agree between nodes; interface names legitimately differ per node.
COMPARED_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")
PROBE_TAG_VARIABLE = "DDPCLI_PROBE_TAG"  # a label (image digest, release) every node must share


# --- Rows ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of the report. `fix` says what to do; it is empty for an ok row."""

    name: str
    status: str
    detail: str
    fix: str = ""
    section: str = ""


def ok(name: str, detail: str) -> Row:
    return Row(name, OK, detail)


def warn(name: str, detail: str, fix: str) -> Row:
    return Row(name, WARN, detail, fix)


def fail(name: str, detail: str, fix: str) -> Row:
    return Row(name, FAIL, detail, fix)


def in_section(section: str, rows: list[Row]) -> list[Row]:
    return [replace(row, section=section) for row in rows]


# --- Options -------------------------------------------------------------------------------


class CheckEnvOptions(BaseModel):
    """What `ddpcli check-env` was asked to check. Field names are the flags."""

    model_config = ConfigDict(extra="forbid")

    ifname: str | None = None
    master_addr: str = Field("127.0.0.1", min_length=1)
    master_port: int = Field(DEFAULT_MASTER_PORT, ge=1, le=65535)
    port_given: bool = False  # by flag or MASTER_PORT; else a one-node probe picks a free port
    backend: Backend = "auto"
    probe: bool = False
    nproc: int | None = Field(None, ge=1, le=256)
    nnodes: int = Field(1, ge=1, le=4096)
    node_rank: int = Field(0, ge=0)
    timeout: float = Field(60.0, gt=0, le=3600, description="seconds to wait for all nodes")
    stage_timeout: float = Field(15.0, gt=0, le=600, description="seconds for each probe stage")

    @model_validator(mode="after")
    def _consistent(self) -> CheckEnvOptions:
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"invalid --node-rank: {self.node_rank} must be below --nnodes {self.nnodes} "
                f"(0..{self.nnodes - 1})"
            )
        if self.nnodes > 1 and is_loopback(self.master_addr):
            raise ValueError(
                f"invalid --master-addr: --nnodes {self.nnodes} needs node 0's address, one "
                f"every node can reach (not {self.master_addr}; set it or MASTER_ADDR)"
            )
        return self

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1


def build_check_options(
    flags: dict[str, Any], environ: dict[str, str] | None = None
) -> CheckEnvOptions:
    """Flags left at None are not given; MASTER_ADDR/MASTER_PORT fill in, as for a run."""
    env = os.environ if environ is None else environ
    values = {key: value for key, value in flags.items() if value is not None}
    if "master_addr" not in values and env.get("MASTER_ADDR"):
        values["master_addr"] = env["MASTER_ADDR"]
    if "master_port" in values:
        values["port_given"] = True
    elif env.get("MASTER_PORT"):
        if not env["MASTER_PORT"].strip().isdigit():
            raise usage_error(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number; fix it")
        values["master_port"], values["port_given"] = int(env["MASTER_PORT"]), True
    try:
        return CheckEnvOptions(**values)
    except ValidationError as error:
        raise usage_error(describe_validation_error(error)) from None


# --- Facts about this node -------------------------------------------------------------------


@dataclass
class Gpu:
    index: int | None  # physical, as nvidia-smi numbers it; None when only torch could tell
    name: str
    memory_mib: int
    uuid: str = ""
    cuda_index: int | None = None  # its number inside a process, given CUDA_VISIBLE_DEVICES


@dataclass
class Interface:
    name: str
    up: bool
    loopback: bool
    addresses: list[str]  # CIDR, IPv4 first

    @property
    def ips(self) -> list[str]:
        return [address.split("/")[0] for address in self.addresses]

    @property
    def ipv4(self) -> list[str]:
        return [ip for ip in self.ips if ":" not in ip]


@dataclass
class Route:
    dev: str
    source: str | None


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


def run_tool(argv: list[str]) -> str | None:
    """A system tool's output, or None when it is missing, fails or takes too long."""
    if not shutil.which(argv[0]):
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except (subprocess.SubprocessError, OSError):
        return None
    return done.stdout if done.returncode == 0 else None


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


def nvidia_driver_version() -> str | None:
    listing = run_tool(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return listing.splitlines()[0].strip() if listing and listing.strip() else None


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
        gpu = next((gpu for gpu in gpus if visible_entry_names(entry, gpu)), None)
        if gpu is None or gpu.cuda_index is not None:
            # CUDA stops at the first entry it cannot use: this one and all after it are lost.
            return entries[position:]
        gpu.cuda_index = position
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


# --- Network facts ---------------------------------------------------------------------------


def list_interfaces() -> list[Interface]:
    listing = run_tool(["ip", "-j", "addr"])
    if listing:
        try:
            return [interface_from_ip(entry) for entry in json.loads(listing)]
        except (ValueError, KeyError):
            pass
    return interfaces_from_sysfs()


def interface_from_ip(entry: dict) -> Interface:
    flags = entry.get("flags", [])
    addresses = [
        f"{info['local']}/{info['prefixlen']}"
        for info in sorted(entry.get("addr_info", []), key=lambda info: info["family"] != "inet")
        if "local" in info
    ]
    return Interface(
        name=entry["ifname"],
        up="UP" in flags and "NO-CARRIER" not in flags,
        loopback="LOOPBACK" in flags,
        addresses=addresses,
    )


def interfaces_from_sysfs() -> list[Interface]:
    """Without iproute2: names from the kernel, state from /sys, the IPv4 address by ioctl."""
    interfaces = []
    for name in network_interfaces():
        flags = read_sysfs_flags(name)
        address = ipv4_by_ioctl(name)
        interfaces.append(
            Interface(
                name=name,
                up=bool(flags & 0x1) and bool(flags & 0x40),  # IFF_UP and IFF_RUNNING
                loopback=bool(flags & 0x8),  # IFF_LOOPBACK
                addresses=[f"{address}/32"] if address else [],
            )
        )
    return interfaces


def read_sysfs_flags(name: str) -> int:
    try:
        with open(f"/sys/class/net/{name}/flags") as handle:
            return int(handle.read().strip(), 16)
    except (OSError, ValueError):
        return 0


def ipv4_by_ioctl(name: str) -> str | None:
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(
                probe.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode())
            )
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def route_to(ip: str) -> Route | None:
    """The interface (and source address) the kernel uses to reach `ip`."""
    listing = run_tool(["ip", "-j", "route", "get", ip])
    if listing:
        try:
            entry = json.loads(listing)[0]
            return Route(entry["dev"], entry.get("prefsrc"))
        except (ValueError, KeyError, IndexError):
            pass
    return route_by_socket(ip)


def route_by_socket(ip: str) -> Route | None:
    """Fallback: connecting a UDP socket sends nothing but picks the source address."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((ip, 9))
            source = probe.getsockname()[0]
    except OSError:
        return None
    holder = next((i for i in list_interfaces() if source in i.ips), None)
    return Route(holder.name, source) if holder else None


def resolve_ip(host: str) -> str | None:
    """The address `host` stands for, IPv4 first; None if it does not resolve in time."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    answer: list[str] = []

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            infos.sort(key=lambda info: info[0] != socket.AF_INET)
            answer.append(infos[0][4][0])
        except (OSError, IndexError):
            pass

    # A daemon thread: a name server that never answers must not hold check-env up.
    worker = threading.Thread(target=lookup, daemon=True)
    worker.start()
    worker.join(RESOLVE_TIMEOUT_S)
    return answer[0] if answer else None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def address_for(ifname: str | None, master_ip: str | None) -> str | None:
    """The address this node talks from: the interface's, or the route's source."""
    if ifname:
        iface = next((i for i in list_interfaces() if i.name == ifname), None)
        return (iface.ipv4 or iface.ips or [None])[0] if iface else None
    route = route_to(master_ip) if master_ip else None
    return route.source if route else None


# --- Ports -----------------------------------------------------------------------------------


def port_is_free(port: int) -> bool:
    """Can the rendezvous store listen on `port` on every address? The store sets
    SO_REUSEADDR, so a connection left in TIME_WAIT does not count as busy."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def port_holder(port: int) -> str | None:
    """'python (pid 123)' for the process listening on `port`, when the system tells."""
    listing = run_tool(["ss", "-Hltnp", f"sport = :{port}"])
    found = re.search(r'\("([^"]+)",pid=(\d+)', listing or "")
    return f"{found.group(1)} (pid {found.group(2)})" if found else None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def try_connect(host: str, port: int) -> str:
    """'open', 'refused', 'timeout' or the OS's reason, within CONNECT_TIMEOUT_S."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as error:
        return errno.errorcode.get(error.errno or 0, "") or str(error)


# --- The master --------------------------------------------------------------------------------


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


# --- Checks: versions and backends ------------------------------------------------------------


def check_versions(facts: NodeFacts, options: CheckEnvOptions) -> list[Row]:
    versions = facts.versions
    rows = [ok("Python", versions["python"]), ok("torch", versions["torch"]), cuda_row(facts)]
    rows.append(ok("cuDNN", versions["cudnn"] or "not available (only GPU convolutions use it)"))
    rows.append(nccl_row(facts, options))
    rows.extend(backend_rows(facts, options))
    return rows


def cuda_row(facts: NodeFacts) -> Row:
    cuda, driver = facts.versions["cuda"], facts.versions["driver"]
    physical = len(facts.gpus) if facts.physical_known else 0
    driver_text = f", driver {driver}" if driver else ""
    if facts.cuda_available:
        return ok("CUDA", f"{cuda}{driver_text}; {facts.visible_gpus} GPU(s) visible to torch")
    if physical == 0:
        build = f"{cuda} build" if cuda else "CPU-only torch build"
        return ok("CUDA", f"{build}; no GPU on this node, so runs use Gloo on the CPU")
    if not cuda:
        return warn(
            "CUDA",
            f"CPU-only torch build, but nvidia-smi shows {physical} GPU(s)",
            "install a CUDA build of torch (see pytorch.org/get-started) to use them",
        )
    hidden = all(gpu.cuda_index is None for gpu in facts.gpus)
    if facts.cuda_visible_devices is not None and hidden:
        return ok("CUDA", f"{cuda}{driver_text}; CUDA_VISIBLE_DEVICES hides every GPU")
    return fail(
        "CUDA",
        f"torch (CUDA {cuda}) cannot use the {physical} GPU(s) nvidia-smi shows{driver_text}",
        f"install an NVIDIA driver that supports CUDA {cuda}, or a torch build for this driver",
    )


def nccl_row(facts: NodeFacts, options: CheckEnvOptions) -> Row:
    if facts.versions["nccl"]:
        return ok("NCCL", facts.versions["nccl"])
    if options.backend == "nccl":
        return fail(
            "NCCL",
            "not in this torch build, but --backend nccl asks for it",
            "install a CUDA build of torch, or use --backend gloo",
        )
    return ok("NCCL", "not in this torch build (CPU runs use Gloo)")


def backend_rows(facts: NodeFacts, options: CheckEnvOptions) -> list[Row]:
    available = facts.backends
    wants_gpu = options.backend == "nccl" or (options.backend == "auto" and facts.visible_gpus > 0)
    rows = []
    if available["gloo"]:
        rows.append(ok("Gloo backend", "available"))
    else:
        rows.append(
            fail(
                "Gloo backend",
                "not available in this torch build",
                "install an official torch wheel: CPU runs and the fallback need Gloo",
            )
        )
    if available["nccl"]:
        rows.append(ok("NCCL backend", "available"))
    elif wants_gpu:
        rows.append(
            fail(
                "NCCL backend",
                "not available, but runs here would use GPUs",
                "install a CUDA build of torch",
            )
        )
    else:
        rows.append(ok("NCCL backend", "not available (not needed on the CPU)"))
    mpi = "available" if available["mpi"] else "not built in (only for a torch built with MPI)"
    rows.append(ok("MPI backend", mpi))
    return rows


# --- Checks: GPUs ------------------------------------------------------------------------------


def check_gpus(facts: NodeFacts, options: CheckEnvOptions) -> list[Row]:
    rows = [visible_devices_row(facts)]
    if not facts.gpus:
        rows.append(ok("GPUs", "none: runs use Gloo on the CPU"))
    for gpu in facts.gpus:
        rows.append(gpu_row(gpu, facts))
    rows.extend(torch_sees_row(facts))
    rows.extend(world_size_rows(facts, options))
    return rows


def visible_devices_row(facts: NodeFacts) -> Row:
    value = facts.cuda_visible_devices
    name = "CUDA_VISIBLE_DEVICES"
    if value is None:
        return ok(name, "unset: a process sees every GPU, numbered as nvidia-smi numbers them")
    if not value.strip():
        return warn(
            name,
            "set but empty: no process sees any GPU, so torch falls back to the CPU",
            "unset it (unset CUDA_VISIBLE_DEVICES) or list the GPUs: CUDA_VISIBLE_DEVICES=0,1",
        )
    if facts.invalid_visible_entries:
        lost = ",".join(facts.invalid_visible_entries)
        return warn(
            name,
            f"{value}: {lost} names no GPU here (or repeats one); CUDA ignores it and every "
            "entry after it",
            "list physical indices as nvidia-smi shows them, each once",
        )
    mapping = [
        f"GPU {gpu.index} is cuda:{gpu.cuda_index}"
        for gpu in facts.gpus
        if gpu.cuda_index is not None and gpu.index is not None
    ]
    renumbered = f" ({', '.join(mapping)} inside a process)" if mapping else ""
    return ok(name, f"{value}{renumbered}")


def gpu_row(gpu: Gpu, facts: NodeFacts) -> Row:
    memory = f"{gpu.memory_mib / 1024:.0f} GiB" if gpu.memory_mib else "memory unknown"
    if gpu.cuda_index is None:
        where = "hidden by CUDA_VISIBLE_DEVICES"
    elif facts.cuda_visible_devices is None:
        where = f"cuda:{gpu.cuda_index}"
    else:
        where = f"cuda:{gpu.cuda_index} inside a process (CUDA_VISIBLE_DEVICES renumbers it)"
    label = f"GPU {gpu.index}" if gpu.index is not None else f"GPU cuda:{gpu.cuda_index}"
    return ok(label, f"{gpu.name} · {memory} · {where}")


def torch_sees_row(facts: NodeFacts) -> list[Row]:
    if not facts.physical_known or not facts.cuda_available:
        return []
    if "MIG-" in (facts.cuda_visible_devices or ""):
        return []
    expected = sum(1 for gpu in facts.gpus if gpu.cuda_index is not None)
    if expected == facts.visible_gpus:
        return []
    return [
        warn(
            "GPUs in torch",
            f"torch sees {facts.visible_gpus} GPU(s) but CUDA_VISIBLE_DEVICES and nvidia-smi "
            f"give {expected}",
            "set CUDA_VISIBLE_DEVICES before anything starts CUDA; check for MIG or a driver issue",
        )
    ]


def world_size_rows(facts: NodeFacts, options: CheckEnvOptions) -> list[Row]:
    """A world size larger than the GPUs on this node can serve: ranks share or miss a GPU."""
    planned = planned_local_processes(facts, options)
    uses_gpus = options.backend == "nccl" or (options.backend == "auto" and facts.visible_gpus > 0)
    if planned is None or not uses_gpus:
        return []
    processes, source = planned
    if processes <= facts.visible_gpus:
        return [
            ok(
                "processes per GPU",
                f"{source}: {processes} process(es) for {facts.visible_gpus} GPU(s)",
            )
        ]
    gpus = facts.visible_gpus
    return [
        warn(
            "processes per GPU",
            f"{source} means {processes} processes on this node, which has {gpus} GPU(s): "
            f"local ranks {gpus}..{processes - 1} have no GPU of their own",
            f"run one process per GPU (--nproc {gpus}, torchrun --nproc-per-node {gpus}), or "
            "use more nodes",
        )
    ]


def planned_local_processes(facts: NodeFacts, options: CheckEnvOptions) -> tuple[int, str] | None:
    if options.nproc:
        return options.nproc, f"--nproc {options.nproc}"
    env = facts.environment
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        if env.get(name, "").isdigit():
            total = int(env[name])
            if name == "WORLD_SIZE":
                total = -(-total // options.nnodes)  # per node, rounded up
            return total, f"{name}={env[name]}"
    return None


# --- Checks: the launcher's variables ------------------------------------------------------------


def check_environment(facts: NodeFacts, options: CheckEnvOptions) -> list[Row]:
    env = facts.environment
    if not env:
        return [
            ok(
                "distributed variables",
                "none set (torchrun or SLURM sets RANK, WORLD_SIZE, MASTER_ADDR... per process)",
            )
        ]
    rows = [variable_row(name, value, facts.interfaces) for name, value in env.items()]
    rows.extend(rank_consistency_rows(env))
    return rows


def variable_row(name: str, value: str, interfaces: list[Interface]) -> Row:
    shown = f"{name}={value}"
    if name in SOCKET_IFNAME_VARIABLES:
        problem = socket_ifname_problem(name, value, interfaces)
        if problem:
            usable = ", ".join(i.name for i in interfaces if i.up and i.addresses)
            return fail(
                name,
                f"{shown}: {problem}, so a run fails at init",
                f"export {name}=IFACE with one that is up and has an address ({usable}): the "
                "one the route to the master uses",
            )
    return ok(name, shown)


def socket_ifname_problem(name: str, value: str, interfaces: list[Interface]) -> str | None:
    """NCCL takes prefixes (`eth`), exact names (`=eth0`) and exclusions (`^docker`);
    Gloo takes exact names, comma-separated."""
    if name == "NCCL_SOCKET_IFNAME" and value.startswith("^"):
        return None
    exact = name == "GLOO_SOCKET_IFNAME" or value.startswith("=")
    parts = [part.strip() for part in value.lstrip("=").split(",") if part.strip()]
    named = [
        iface
        for iface in interfaces
        if any(iface.name == part if exact else iface.name.startswith(part) for part in parts)
    ]
    if not named:
        return "names no interface on this node"
    if not any(iface.up and iface.addresses for iface in named):
        return f"{', '.join(i.name for i in named)} is down or holds no address"
    return None


def rank_consistency_rows(env: dict[str, str]) -> list[Row]:
    rows = []
    if ("RANK" in env) != ("WORLD_SIZE" in env):
        rows.append(
            warn(
                "RANK / WORLD_SIZE",
                "only one of RANK and WORLD_SIZE is set; a launcher sets both",
                "unset the stray one, or launch through torchrun / ddpcli train",
            )
        )
    rank, world = env.get("RANK", ""), env.get("WORLD_SIZE", "")
    if rank.isdigit() and world.isdigit() and int(rank) >= int(world):
        rows.append(
            fail(
                "RANK / WORLD_SIZE",
                f"RANK={rank} is not below WORLD_SIZE={world}: this rank can never join",
                "ranks run 0..WORLD_SIZE-1; check the launcher's --nnodes/--nproc-per-node",
            )
        )
    return rows


# --- Checks: network -------------------------------------------------------------------------


def check_network(facts: NodeFacts, options: CheckEnvOptions, master: Master) -> list[Row]:
    rows = [interface_row(iface, master) for iface in facts.interfaces]
    rows.append(hostname_row(facts, options))
    rows.extend(several_interfaces_rows(facts, options, master))
    rows.extend(master_rows(options, master))
    if options.ifname:
        rows.extend(ifname_rows(facts, options, master))
    return rows


def interface_row(iface: Interface, master: Master) -> Row:
    state = "up" if iface.up else "down"
    addresses = ", ".join(iface.addresses) or "no address"
    route = " · the route to the master leaves here" if master.interface == iface.name else ""
    return ok(f"interface {iface.name}", f"{state} · {addresses}{route}")


def socket_ifname_chosen(options: CheckEnvOptions, facts: NodeFacts) -> bool:
    return bool(options.ifname) or any(
        name in facts.environment for name in SOCKET_IFNAME_VARIABLES
    )


def hostname_row(facts: NodeFacts, options: CheckEnvOptions) -> Row:
    name = "host name"
    chosen = socket_ifname_chosen(options, facts)
    if facts.host_address is None:
        detail = f"{facts.host} does not resolve; Gloo needs it unless an interface is named"
        if chosen:
            return ok(name, detail)
        return warn(name, detail, "pass --ifname IFACE (or export GLOO_SOCKET_IFNAME=IFACE)")
    detail = f"{facts.host} → {facts.host_address}"
    if not is_loopback(facts.host_address):
        return ok(name, detail)
    if options.multi_node and not chosen:
        return warn(
            name,
            f"{detail} (loopback): without an interface Gloo advertises that address, which "
            "other nodes cannot reach",
            "pass --ifname IFACE (or export GLOO_SOCKET_IFNAME=IFACE NCCL_SOCKET_IFNAME=IFACE)",
        )
    return ok(name, f"{detail} (loopback: fine on one node; on several, name an interface)")


def several_interfaces_rows(
    facts: NodeFacts, options: CheckEnvOptions, master: Master
) -> list[Row]:
    candidates = [i.name for i in facts.interfaces if i.up and not i.loopback and i.ipv4]
    if len(candidates) < 2 or socket_ifname_chosen(options, facts):
        return []
    best = master.interface if master.interface in candidates else candidates[0]
    return [
        warn(
            "interface choice",
            f"{len(candidates)} interfaces carry IPv4 ({', '.join(candidates)}) and none is "
            "named: Gloo and NCCL may pick one the other nodes cannot reach",
            f"pass --ifname {best} (or export GLOO_SOCKET_IFNAME={best} NCCL_SOCKET_IFNAME={best})",
        )
    ]


def master_rows(options: CheckEnvOptions, master: Master) -> list[Row]:
    name = "master address"
    if master.ip is None:
        return [
            fail(
                name,
                f"{master.addr} does not resolve (within {RESOLVE_TIMEOUT_S:g}s)",
                "give node 0's IP address as --master-addr (or MASTER_ADDR)",
            )
        ]
    shown = master.addr if master.addr == master.ip else f"{master.addr} ({master.ip})"
    where = "this node" if master.this_node else f"another host, reached through {master.interface}"
    rows = [ok(name, f"{shown}:{master.port} · {where}")]
    rows.extend(master_placement_rows(options, master, shown))
    if ipaddress.ip_address(master.ip).is_global:
        rows.append(
            warn(
                "master exposure",
                f"{master.ip} is a public address, and the rendezvous store (TCPStore) on port "
                f"{master.port} has no authentication: anyone who reaches it can join or stall "
                "the job",
                "use node 0's private address (a cluster network), or firewall the master port",
            )
        )
    return rows


def master_placement_rows(options: CheckEnvOptions, master: Master, shown: str) -> list[Row]:
    if not options.multi_node:
        return []
    if master.loopback:
        return [
            fail(
                "master address",
                f"{shown} is loopback: the other {options.nnodes - 1} node(s) cannot reach it",
                "give node 0's address on the network the nodes share",
            )
        ]
    if options.node_rank == 0 and not master.this_node:
        return [
            fail(
                "node rank",
                f"--node-rank 0 makes this node the master, but {shown} is not one of its "
                "addresses",
                "run --node-rank 0 on the node that holds --master-addr, or fix the address",
            )
        ]
    if options.node_rank > 0 and master.this_node:
        return [
            fail(
                "node rank",
                f"{shown} belongs to this node, but --node-rank {options.node_rank} says "
                "another node is the master",
                "use --node-rank 0 here, or point --master-addr at node 0",
            )
        ]
    return []


def ifname_rows(facts: NodeFacts, options: CheckEnvOptions, master: Master) -> list[Row]:
    iface = facts.interface(options.ifname)
    name = f"--ifname {options.ifname}"
    if iface is None:  # the kernel knows it, `ip` did not list it
        return [warn(name, "exists, but its state and addresses could not be read", "ip addr")]
    others = ", ".join(i.name for i in facts.interfaces if i.up and i.addresses and i is not iface)
    if not iface.up:
        fix = f"ip link set {iface.name} up, or choose one of: {others}"
        return [fail(name, f"{iface.name} is down", fix)]
    if not iface.addresses:
        fix = f"choose one that has an address: {others}"
        return [fail(name, f"{iface.name} is up but holds no address", fix)]
    rows = [ok(name, f"up · {', '.join(iface.addresses)} · {ifname_effect(iface.name, facts)}")]
    if iface.loopback and options.multi_node:
        rows.append(
            fail(name, "loopback cannot reach other nodes", "name the interface the nodes share")
        )
    elif master.interface and master.interface != iface.name and not master.loopback:
        rows.append(
            warn(
                "route to the master",
                f"traffic to the master {master.ip} leaves through {master.interface}, not "
                f"{iface.name}",
                f"use --ifname {master.interface}, or fix the route to {master.ip}",
            )
        )
    return rows


def ifname_effect(ifname: str, facts: NodeFacts) -> str:
    overridden = [
        f"{name}={facts.environment[name]}"
        for name in SOCKET_IFNAME_VARIABLES
        if facts.environment.get(name, ifname) != ifname
    ]
    effect = f"a run sets GLOO_SOCKET_IFNAME={ifname} and NCCL_SOCKET_IFNAME={ifname}"
    return effect + (f" (replacing {', '.join(overridden)})" if overridden else "")


# --- Checks: the master port --------------------------------------------------------------------


def check_ports(facts: NodeFacts, options: CheckEnvOptions, master: Master) -> list[Row]:
    name = f"master port {master.port}"
    if hosts_master(options, master):
        return [local_port_row(name, master.port)]
    if options.probe or master.ip is None:
        return []  # the probe waits for the master itself; an unresolved name is already failed
    return [remote_port_row(name, master)]


def local_port_row(name: str, port: int) -> Row:
    if port_is_free(port):
        return ok(name, f"port {port} is free on this node (the master listens there)")
    holder = port_holder(port)
    held = f", held by {holder}" if holder else ""
    stop = f", or stop {holder}" if holder else ""
    return fail(
        name,
        f"port {port} is busy on this node{held}: the master cannot listen there",
        f"pick a free port (--master-port {free_port()} / MASTER_PORT){stop}",
    )


def remote_port_row(name: str, master: Master) -> Row:
    result = try_connect(master.ip, master.port)
    target = f"{master.addr}:{master.port}"
    if result == "open":
        return ok(name, f"{target} is reachable and something listens (the master is up)")
    if result == "refused":
        return ok(name, f"{master.addr} answers; nothing listens on {master.port} yet (normal "
                  "before node 0 starts)")  # fmt: skip
    return fail(
        name,
        f"{target} cannot be reached ({result}) within {CONNECT_TIMEOUT_S:g}s",
        f"check --master-addr and the route to it; open TCP port {master.port} (and the ports "
        "Gloo/NCCL pick) between the nodes",
    )


# --- The report --------------------------------------------------------------------------------


@dataclass
class Report:
    rows: list[Row]
    facts: NodeFacts
    master: Master
    probe: dict | None = None
    counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.counts = {
            status: sum(r.status == status for r in self.rows) for status in (OK, WARN, FAIL)
        }

    @property
    def failed(self) -> bool:
        return self.counts[FAIL] > 0

    def to_json(self) -> dict:
        return {
            "ok": not self.failed,
            "exit_code": 1 if self.failed else 0,
            "counts": self.counts,
            "checks": [asdict(row) for row in self.rows],
            "host": self.facts.host,
            "versions": self.facts.versions,
            "backends": self.facts.backends,
            "gpus": [asdict(gpu) for gpu in self.facts.gpus],
            "cuda_visible_devices": self.facts.cuda_visible_devices,
            "interfaces": [asdict(iface) for iface in self.facts.interfaces],
            "environment": self.facts.environment,
            "master": asdict(self.master),
            "probe": self.probe,
        }


def no_progress(message: str) -> None:
    """The default: the engine prints nothing; the CLI passes ui.info for progress lines."""


def run_checks(options: CheckEnvOptions, progress: Callable[[str], None] = no_progress) -> Report:
    """Every check, then the probe when asked. Bad input raises a usage error (exit 2)."""
    if options.ifname:
        check_interface(options.ifname)  # exit 2, listing the interfaces that exist
    facts = collect_facts()
    master = locate_master(options, facts)
    rows = [
        *in_section("versions", check_versions(facts, options)),
        *in_section("GPUs", check_gpus(facts, options)),
        *in_section("environment", check_environment(facts, options)),
        *in_section("network", check_network(facts, options, master)),
        *in_section("ports", check_ports(facts, options, master)),
    ]
    probe = None
    if options.probe:
        from ddpcli.probe import run_probe

        probe_rows, probe = run_probe(options, facts, master, progress)
        rows.extend(in_section("probe", probe_rows))
    return Report(rows, facts, master, probe)
