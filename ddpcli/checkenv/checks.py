"""The checks: plain functions of this node's facts and the options that return rows of
(name, status, detail, fix). `run_checks` reads the node once and runs them all; the probe
(ddpcli.checkenv.probe) is run after it, by the command, with its facts."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

from ddpcli.checkenv.facts import (
    SOCKET_IFNAME_VARIABLES,
    Gpu,
    NodeFacts,
    collect_facts,
    locate_master,
)
from ddpcli.checkenv.network_checks import network_rows, port_rows
from ddpcli.checkenv.report import Report, Row, fail, in_section, ok, warn
from ddpcli.config.checkenv import CheckEnvOptions
from ddpcli.config.train import build_train_config
from ddpcli.environments.pods import pet_variables
from ddpcli.environments.world import DEFAULT_MASTER_PORT
from ddpcli.errors import DdpcliError, first_line
from ddpcli.launcher.resolve import gpus_torch_cannot_use
from ddpcli.machine import check_interface
from ddpcli.network import Interface
from ddpcli.process import ROOM_FOR_TMPDIR, multiprocessing_sockets_fit


def run_checks(options: CheckEnvOptions) -> Report:
    """Every check on this node. Bad input raises a usage error (exit 2)."""
    if options.ifname:
        check_interface(options.ifname)  # exit 2, listing the interfaces that exist
    facts = collect_facts()
    master = locate_master(options, facts)
    rows = [
        *in_section("versions", version_rows(facts, options)),
        *in_section("GPUs", gpu_rows(facts, options)),
        *in_section("environment", environment_rows(facts, options)),
        *in_section("network", network_rows(facts, options, master)),
        *in_section("ports", port_rows(options, master)),
    ]
    return Report(rows, facts, master)


# --- Checks: versions and backends ----------------------------------------------------------


def version_rows(facts: NodeFacts, options: CheckEnvOptions) -> list[Row]:
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
    hidden = all(gpu.cuda_index is None for gpu in facts.gpus)
    if facts.cuda_visible_devices is not None and hidden:
        build = f"{cuda}{driver_text}" if cuda else "CPU-only torch build"
        return ok("CUDA", f"{build}; CUDA_VISIBLE_DEVICES hides every GPU")
    # What `ddpcli train` and `bench-barrier --gpus` refuse to start with (exit 2), in their words.
    problem, fix = gpus_torch_cannot_use(facts.versions["torch"], cuda, driver or None, physical)
    return fail("CUDA", problem, f"{fix}, or run on the CPU (ddpcli train --cpu)")


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


# --- Checks: GPUs ----------------------------------------------------------------------------


def gpu_rows(facts: NodeFacts, options: CheckEnvOptions) -> list[Row]:
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
        return ok(
            name,
            "unset: a process sees every GPU, numbered as nvidia-smi numbers them (in "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID, which ddpcli sets for its workers); "
            "`ddpcli train` without --gpus uses them all",
        )
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
    return ok(
        name,
        f"{value}{renumbered}; `ddpcli train` uses only these GPUs (--gpus picks among them, "
        "by nvidia-smi index) in PCI bus order",
    )


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


# --- Checks: the launcher's variables --------------------------------------------------------


def environment_rows(facts: NodeFacts, options: CheckEnvOptions) -> list[Row]:
    env = facts.environment
    if not env:
        return [
            ok(
                "distributed variables",
                "none set (torchrun or SLURM sets RANK, WORLD_SIZE, MASTER_ADDR... per process)",
            ),
            tmpdir_row(),
            bytecode_row(),
        ]
    rows = [variable_row(name, value, facts.interfaces) for name, value in env.items()]
    if pet_variables(env):
        rows.append(pod_row(env))
    else:
        rows.extend(rank_consistency_rows(env))
    return [*rows, tmpdir_row(), bytecode_row()]


def tmpdir_row() -> Row:
    """multiprocessing makes its UNIX sockets in the temporary folder (ddpcli.process)."""
    folder = tempfile.gettempdir()
    if multiprocessing_sockets_fit():
        return ok("TMPDIR", f"{folder}: room for multiprocessing's sockets")
    return warn(
        "TMPDIR",
        f"{folder} is {len(os.fsencode(folder))} bytes: multiprocessing's UNIX sockets in it "
        "would pass 107 bytes, so DataLoader workers cannot hand batches over (a script's "
        "loader waits for good; ddpcli train exits 2) and CPU workers start slower",
        f"export TMPDIR=/tmp, or any folder of at most {ROOM_FOR_TMPDIR} bytes",
    )


def bytecode_row() -> Row:
    """Whether Python keeps torch's compiled modules. Where it cannot (bytecode writing off,
    or a folder it cannot write) and pip installed torch without them (--no-compile), every
    process of a job compiles torch's Python as it starts: 3.5 CPU-seconds more for
    `import torch, torch._dynamo` on a 2-core VM (docs/performance.md)."""
    spec = importlib.util.find_spec("torch")  # found, not imported
    if spec is None or not spec.origin:
        return ok("Python bytecode", "torch is not installed")
    compiled = Path(importlib.util.cache_from_source(spec.origin))
    if compiled.exists():
        return ok("Python bytecode", f"torch's compiled modules are kept ({compiled.parent})")
    compile_once = f"python -m compileall -q {Path(spec.origin).parent}"
    if sys.dont_write_bytecode:
        reason = "PYTHONDONTWRITEBYTECODE is set (or python -B)"
        fix = f"unset PYTHONDONTWRITEBYTECODE, or compile them once: {compile_once}"
    elif not writable_folder(compiled.parent):
        reason = f"{compiled.parent} cannot be written"
        fix = (
            "export PYTHONPYCACHEPREFIX=$HOME/.cache/pycache (a folder you can write), or "
            f"have whoever installed torch run {compile_once}"
        )
    else:
        return ok("Python bytecode", "compiled as modules are first imported, then kept")
    return warn(
        "Python bytecode",
        f"{reason}, and torch has no compiled modules: every process of a job compiles "
        "torch's Python as it starts (several CPU-seconds each)",
        fix,
    )


def writable_folder(folder: Path) -> bool:
    """FOLDER, or the nearest folder above it that exists (Python makes the rest), can be
    written."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return os.access(folder, os.W_OK)


def pod_row(env: dict[str, str]) -> Row:
    """What `ddpcli train` would make of a pod's PET_* variables, with no flags given."""
    try:
        cfg = build_train_config({}, None, env)
    except DdpcliError as error:
        return fail("PET_* (pod)", first_line(error), "fix the variable, or give the flag")
    processes = f"--nproc {cfg.nproc}" if cfg.nproc else "one process per GPU, else 2"
    if cfg.elastic:
        host, port = cfg.rendezvous_address(DEFAULT_MASTER_PORT)
        nodes = f"{cfg.min_nnodes or cfg.nnodes} to {cfg.nnodes} nodes meeting at {host}:{port}"
        world = f"c10d rendezvous of {nodes} (no node rank)"
    elif cfg.nnodes > 1:
        host, port = cfg.rendezvous_address(DEFAULT_MASTER_PORT)
        world = f"node {cfg.node_rank} of {cfg.nnodes}, meeting node 0 at {host}:{port}"
    else:
        world = "one node"
    pods = " (RANK/WORLD_SIZE here are the operator's pod index and count)" if "RANK" in env else ""
    return ok("PET_* (pod)", f"a run here: {world}, {processes}{pods}")


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
