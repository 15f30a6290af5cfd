"""The run's configuration: pydantic models, recipe loading, and the one place that
reads flags, recipes and the launcher's environment variables.

Precedence: built-in defaults < recipe file < command-line flags. `resolve_train_config`
then fills every "auto" value from the machine, so `config.json` holds what really ran.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ddpcli.errors import usage_error

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Backend = Literal["auto", "nccl", "gloo"]
Precision = Literal["auto", "bf16", "fp16", "fp32"]
DatasetName = Literal["synthetic", "stl10", "imagefolder"]


class TrainConfig(BaseModel):
    """Everything `ddpcli train` needs. Field names are the flags with `_` for `-`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # data
    dataset: DatasetName = "synthetic"
    data_dir: Path | None = None
    download: bool = False
    image_size: int | None = Field(None, ge=8, le=1024)
    synthetic_size: int = Field(4096, ge=16, description="training images of the synthetic set")
    data_path: Literal["auto", "device", "loader"] = "auto"
    workers: int | None = Field(None, ge=0, description="DataLoader workers per rank")
    # model and optimisation
    arch: str | None = None
    epochs: int = Field(5, ge=1)
    per_gpu_batch: int = Field(64, ge=1)
    accumulate: int = Field(1, ge=1)
    lr: float = Field(0.1, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(5e-4, ge=0)
    warmup_epochs: float = Field(1.0, ge=0)
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    seed: int = Field(0, ge=0)
    precision: Precision = "auto"
    compile: bool = False
    max_steps: int | None = Field(None, ge=1)
    # processes and devices
    gpus: list[int] | None = None
    cpu: bool = False
    nproc: int | None = Field(None, ge=1, le=1024)
    backend: Backend = "auto"
    strategy: Literal["ddp", "dp", "balanced-dp"] = "ddp"
    gpu0_batch: int | None = Field(None, ge=1)
    bucket_cap_mb: float = Field(
        25.0, gt=0, description="DDP gradient bucket size (MB): fewer, larger all-reduces"
    )
    # multi-node
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    master_addr: str = "127.0.0.1"
    master_port: int | None = Field(None, ge=1, le=65535)
    init_method: str | None = None
    ifname: str | None = None
    timeout: float = Field(300.0, gt=0, description="seconds for init and every collective")
    max_restarts: int = Field(0, ge=0)
    # outputs
    out: Path | None = None
    resume: str | None = None
    save_every_steps: int | None = Field(None, ge=1)
    keep_last: int = Field(3, ge=0)
    log_dir: Path | None = None
    log_every: int = Field(10, ge=1, description="steps between progress lines")

    @field_validator("gpus", mode="before")
    @classmethod
    def _parse_gpu_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_int_list(value, "gpus")
        return value

    @field_validator("gpus")
    @classmethod
    def _gpus_unique(cls, value: list[int] | None) -> list[int] | None:
        if value is not None:
            if not value:
                raise ValueError("give at least one GPU index, e.g. --gpus 0,1")
            if any(index < 0 for index in value):
                raise ValueError("GPU indices are 0 or more, as nvidia-smi numbers them")
            if len(set(value)) != len(value):
                raise ValueError(f"each GPU may be listed once (got {value})")
        return value

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

    @field_validator("resume")
    @classmethod
    def _resume_value(cls, value: str | None) -> str | None:
        return None if value in (None, "", "none") else value

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"invalid --node-rank: {self.node_rank} must be below --nnodes {self.nnodes} "
                f"(0..{self.nnodes - 1})"
            )
        if self.cpu and self.gpus:
            raise ValueError("invalid --cpu: --cpu and --gpus exclude each other; pick one")
        if self.dataset != "synthetic" and self.data_dir is None:
            raise ValueError(f"invalid --data-dir: --dataset {self.dataset} needs --data-dir DIR")
        if self.strategy == "balanced-dp" and self.gpu0_batch is None:
            raise ValueError("invalid --gpu0-batch: --strategy balanced-dp needs --gpu0-batch N")
        return self

    # Values derived from the config, never stored twice.
    @property
    def uses_gpus(self) -> bool:
        return not self.cpu and bool(self.gpus)

    @property
    def nproc_per_node(self) -> int:
        if self.strategy != "ddp":
            return 1
        return len(self.gpus) if self.uses_gpus else (self.nproc or 2)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def global_batch(self) -> int:
        return self.per_gpu_batch * self.world_size * self.accumulate


def parse_int_list(text: str, name: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise ValueError(f"{name} takes a comma-separated list of integers, e.g. 0,3") from None


def parse_float_list(text: str, name: str) -> list[float]:
    try:
        return [float(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise ValueError(f"{name} takes a comma-separated list of numbers, e.g. 3,5") from None


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem, naming the flag and what is allowed."""
    lines = []
    for problem in error.errors():
        field = ".".join(str(part) for part in problem["loc"] if not isinstance(part, int))
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            message = "is not a known setting (see `ddpcli train --help`)"
        message = message.replace("Input should be", "must be")
        if not field:  # a rule across fields: its message names the flags itself
            lines.append(message)
            continue
        flag = f"--{field.replace('_', '-')}"
        given = problem.get("input")
        shown = "" if isinstance(given, dict) else f" (got {given!r})"
        lines.append(f"invalid {flag}: {message}{shown}")
    return "\n".join(lines[:2])


def load_recipe(path: Path) -> dict[str, Any]:
    """A recipe is a TOML file of flag names (`per_gpu_batch = 32` or `per-gpu-batch = 32`),
    at the top level or under a `[train]` table."""
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        raise usage_error(f"recipe {path} does not exist; see recipes/ for examples") from None
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise usage_error(f"recipe {path} is not readable TOML: {error}") from None
    table = data.get("train", data)
    if not isinstance(table, dict):
        raise usage_error(f"recipe {path}: [train] must be a table of settings")
    return {key.replace("-", "_"): value for key, value in table.items()}


def build_train_config(flags: dict[str, Any], recipe: Path | None) -> TrainConfig:
    """Defaults < recipe < flags; flags left at None mean "not given"."""
    values = load_recipe(recipe) if recipe else {}
    values.update({key: value for key, value in flags.items() if value is not None})
    try:
        return TrainConfig(**values)
    except ValidationError as error:
        raise usage_error(describe_validation_error(error)) from None


def default_out_dir() -> Path:
    return Path("runs") / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


# --- The launcher's environment -------------------------------------------------------


class LauncherEnv(BaseModel):
    """Rank information a launcher (torchrun, the legacy launcher, SLURM, or our own
    elastic agent) hands to a worker through environment variables."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    launcher: str = "torchrun"
    agent_store: bool = False  # the elastic agent serves a TCPStore at MASTER_ADDR:PORT


def _slurm_master_addr(nodelist: str) -> str:
    """First host of a SLURM node list such as `gpu[01-04,07],login1` -> `gpu01`
    (`node[1-2]-ib` -> `node1-ib`); rank 0 runs there. No list: this machine."""
    first = re.match(r"([^,\[]+)(?:\[([^\]]+)\]([^,\[]*))?", nodelist.strip())
    if not first:
        return "127.0.0.1"
    prefix, ranges, suffix = first.group(1), first.group(2), first.group(3) or ""
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def _slurm_tasks_on_node(env) -> int:
    """Tasks on this node: SLURM_NTASKS_PER_NODE is set only with --ntasks-per-node;
    SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE read like `4(x2),2`, one entry per node."""
    spec = (
        env.get("SLURM_NTASKS_PER_NODE")
        or env.get("SLURM_STEP_TASKS_PER_NODE")
        or env.get("SLURM_TASKS_PER_NODE", "")
    )
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match:
            counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not counts:
        return 1
    return counts[min(int(env.get("SLURM_NODEID", 0)), len(counts) - 1)]


def _slurm_master_port(env) -> int:
    """MASTER_PORT if set; else one derived from the job id, so two jobs sharing a node
    do not both take 29500 (Lightning's rule)."""
    if env.get("MASTER_PORT"):
        return int(env["MASTER_PORT"])
    job_id = env.get("SLURM_JOB_ID", "")
    return 15000 + int(job_id) % 10000 if job_id.isdigit() else 29500


def read_launcher_env(environ: dict[str, str] | None = None) -> LauncherEnv | None:
    """The worker's place in the world when a launcher started us, else None."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = int(env["WORLD_SIZE"])
        return LauncherEnv(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=world_size,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
            node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))),
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None,
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
            launcher="elastic" if "TORCHELASTIC_RUN_ID" in env else "env",
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        nodelist = (
            env.get("SLURM_STEP_NODELIST")
            or env.get("SLURM_NODELIST")
            or env.get("SLURM_JOB_NODELIST", "")
        )
        return LauncherEnv(
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=int(env["SLURM_NTASKS"]),
            local_world_size=_slurm_tasks_on_node(env),
            node_rank=int(env.get("SLURM_NODEID", 0)),
            master_addr=env.get("MASTER_ADDR") or _slurm_master_addr(nodelist),
            master_port=_slurm_master_port(env),
            launcher="slurm",
        )
    return None


def debug_requested(flag: bool) -> bool:
    return flag or os.environ.get("DDPCLI_DEBUG", "") not in ("", "0")


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


# --- Resolution against the machine (imports torch lazily) --------------------------------


def physical_gpu_count() -> int:
    """GPUs as nvidia-smi numbers them, regardless of CUDA_VISIBLE_DEVICES, without
    creating a CUDA context in this (launcher) process."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        try:
            listing = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True
            ).stdout
            return sum(1 for line in listing.splitlines() if line.startswith("GPU "))
        except (subprocess.SubprocessError, OSError):
            pass
    import torch

    return torch.cuda.device_count() if "CUDA_VISIBLE_DEVICES" not in os.environ else 0


def network_interfaces() -> list[str]:
    import socket

    return sorted(name for _, name in socket.if_nameindex())


def check_interface(name: str) -> None:
    names = network_interfaces()
    if name not in names:
        raise usage_error(
            f"invalid --ifname: interface {name!r} does not exist; this machine has: "
            f"{', '.join(names)}"
        )


def resolve_train_config(cfg: TrainConfig, launcher: LauncherEnv | None) -> TrainConfig:
    """Fill every "auto" value from the machine and check what only the machine can tell:
    GPUs that exist, data that is there, a model name torchvision knows."""
    from ddpcli import data
    from ddpcli.archs import check_arch

    values = cfg.model_dump()
    if launcher is None:
        _resolve_devices(values)
    else:
        import torch

        values["cpu"] = values["cpu"] or not torch.cuda.is_available()
    _check_strategy(values, launcher)
    on_gpu = not values["cpu"]
    values["arch"] = values["arch"] or ("resnet18" if on_gpu else "smallcnn")
    check_arch(values["arch"])
    if values["image_size"] is None:
        native = {"synthetic": 32, "stl10": data.STL10_SIDE, "imagefolder": 224 if on_gpu else 64}
        values["image_size"] = native[cfg.dataset]
    values["out"] = values["out"] or default_out_dir()
    _resolve_agent_address(values)
    _check_data(cfg)
    if cfg.ifname:
        check_interface(cfg.ifname)
    if launcher is None or launcher.rank == 0:
        _check_init_file(cfg)
    return TrainConfig(**values)


def _check_strategy(values: dict[str, Any], launcher: LauncherEnv | None) -> None:
    """dp and balanced-dp are one process driving two or more GPUs of one machine."""
    strategy = values["strategy"]
    if values["gpu0_batch"] is not None and strategy != "balanced-dp":
        raise usage_error("invalid --gpu0-batch: it applies to --strategy balanced-dp only")
    if strategy == "ddp":
        return
    if (launcher is not None and launcher.world_size > 1) or values["nnodes"] > 1:
        raise usage_error(
            f"invalid --strategy: {strategy} is a single process on one machine; for several "
            "processes or nodes use --strategy ddp (the default)"
        )
    if values["cpu"]:
        gpus = 0
    elif launcher is not None:
        import torch

        gpus = torch.cuda.device_count()
    else:
        gpus = len(values["gpus"])
    if gpus < 2:
        have = "is on the CPU" if values["cpu"] else f"has {gpus} GPU"
        raise usage_error(
            f"invalid --strategy: {strategy} is one process driving 2 or more GPUs, but this "
            f"run {have}; use --strategy ddp (the default), or list GPUs with --gpus 0,1"
        )
    if values["compile"]:
        raise usage_error(
            f"invalid --compile: it works with --strategy ddp; {strategy} replicates the "
            "module on every step"
        )
    batch, gpu0_batch = values["per_gpu_batch"], values["gpu0_batch"]
    if strategy == "balanced-dp" and batch - gpu0_batch < gpus - 1:
        raise usage_error(
            f"invalid --gpu0-batch: {gpu0_batch} of a batch of {batch} leaves less than one "
            f"sample for each of the other {gpus - 1} GPUs; lower it or raise --per-gpu-batch"
        )


def _resolve_agent_address(values: dict[str, Any]) -> None:
    """Where the node agents meet: --master-addr:--master-port (29500 on several nodes).
    With tcp://HOST:PORT the workers' process group listens on PORT itself, so the agents
    default to HOST and PORT+1: two ports, derived the same way on every node."""
    method = values["init_method"] or ""
    if not method.startswith("tcp://"):
        if values["nnodes"] > 1 and values["master_port"] is None:
            values["master_port"] = 29500
        return
    host, port_text = method.removeprefix("tcp://").rsplit(":", 1)
    port = int(port_text)
    if values["nnodes"] > 1:
        if values["master_addr"] == "127.0.0.1":
            values["master_addr"] = host
        if values["master_port"] is None:
            values["master_port"] = port + 1 if port < 65535 else port - 1
    if values["master_port"] == port:
        raise usage_error(
            f"invalid --master-port: {port} is the --init-method port, where the workers' "
            "process group listens; the node agents need another one (or leave it out)"
        )


def _check_init_file(cfg: TrainConfig) -> None:
    """file:// init on a file an earlier run left: the new run would hang or fail."""
    if not (cfg.init_method or "").startswith("file://") or cfg.node_rank != 0:
        return
    path = Path(cfg.init_method.removeprefix("file://"))
    if path.exists():
        raise usage_error(
            f"invalid --init-method: {path} already exists, probably left by an earlier run; "
            f"if no run is using it, delete it (rm {path}) or give a new file name"
        )
    if not path.parent.is_dir():
        raise usage_error(f"invalid --init-method: folder {path.parent} does not exist")


def _resolve_devices(values: dict[str, Any]) -> None:
    if values["cpu"]:
        values["nproc"] = values["nproc"] or 2
        return
    count = physical_gpu_count()
    if values["gpus"] is None:
        if count == 0:
            values["cpu"], values["nproc"] = True, values["nproc"] or 2
        else:
            values["gpus"] = list(range(count))
        return
    missing = [index for index in values["gpus"] if index >= count]
    if missing:
        have = f"GPUs 0..{count - 1}" if count else "no GPU"
        raise usage_error(
            f"invalid --gpus: GPU {missing[0]} does not exist (this machine has {have}); "
            "list indices as nvidia-smi shows them, or use --cpu"
        )


def _check_data(cfg: TrainConfig) -> None:
    from ddpcli import data

    if cfg.dataset == "synthetic":
        return
    if not cfg.data_dir.is_dir() and not (cfg.dataset == "stl10" and cfg.download):
        hint = "; add --download to fetch STL-10 into it" if cfg.dataset == "stl10" else ""
        raise usage_error(
            f"invalid --data-dir: {cfg.data_dir} does not exist or is not a folder{hint}"
        )
    if cfg.dataset == "stl10" and not cfg.download and not data.stl10_present(cfg.data_dir):
        raise usage_error(
            f"STL-10 not found in {data.stl10_dir(cfg.data_dir)}; pass --download to fetch it "
            "or point --data-dir at the folder that holds stl10_binary/"
        )
    if cfg.dataset == "imagefolder":
        data.check_imagefolder(cfg.data_dir)


def sample_trace_path() -> Path | None:
    """DDPCLI_TRACE_SAMPLES=PATH: each rank appends the sample indices of every training batch
    it is handed to PATH.rankN, one JSON line per batch. A debugging aid, and the evidence the
    resume tests use that no sample is trained twice or missed (docs/checkpoints.md)."""
    value = os.environ.get("DDPCLI_TRACE_SAMPLES", "")
    return Path(value) if value else None


# --- ddpcli bench-barrier ------------------------------------------------------------------

from pydantic import ValidationInfo  # noqa: E402  (kept with the section that uses it)

BarrierDemo = Literal["staggered", "zero-first", "none"]
CollectiveName = Literal["all_reduce", "all_gather", "broadcast"]
SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
MAX_MESSAGE_BYTES = 16 << 30
DEFAULT_STAGGER_S = 0.25  # staggered demo without --sleeps/--stagger: rank r sleeps 0.25 x r
DEFAULT_WORK_S = 0.3  # zero-first demo without --sleeps/--stagger: every rank works 0.3 s


def parse_size_list(text: str, name: str) -> list[int]:
    """Byte counts the way nccl-tests writes them: 4,1K,1M,64M (K, M, G are powers of 1024)."""
    sizes = []
    for part in text.replace(" ", "").upper().split(","):
        if part == "":
            continue
        match = re.fullmatch(r"(\d+)([KMG]?)(?:I?B)?", part)
        if not match:
            raise ValueError(
                f"{name} takes a comma-separated list of byte counts, e.g. 4,1K,1M,64M"
            )
        sizes.append(int(match.group(1)) * SIZE_UNITS[match.group(2)])
    return sizes


class BarrierConfig(BaseModel):
    """Everything `ddpcli bench-barrier` needs. Field names are the flags with `_` for `-`.

    Fields that depend on the number of ranks come after `nproc` and `gpus`, so their
    validators can check against it and name the flag that is wrong.
    """

    model_config = ConfigDict(extra="forbid")

    nproc: int | None = Field(None, ge=1, le=1024)
    gpus: list[int] | None = None
    backend: Backend = "auto"
    demo: BarrierDemo = "staggered"
    sleeps: list[float] | None = None
    stagger: float | None = Field(None, ge=0, le=3600)
    iters: int = Field(200, ge=1, le=10_000_000)
    warmup: int = Field(10, ge=0, le=1_000_000)
    collective: list[CollectiveName] = Field(default_factory=list)
    sizes: list[int] = Field(default_factory=lambda: parse_size_list("4,1K,1M,64M", "sizes"))
    skip_rank: int | None = Field(None, ge=0)
    timeout: float = Field(30.0, gt=0, le=86400, description="seconds a rank waits at a barrier")

    @field_validator("gpus", mode="before")
    @classmethod
    def _parse_gpu_list(cls, value: Any) -> Any:
        return parse_int_list(value, "gpus") if isinstance(value, str) else value

    @field_validator("gpus")
    @classmethod
    def _gpus_valid(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("give at least one GPU index, e.g. --gpus 0,1")
        if any(index < 0 for index in value):
            raise ValueError("GPU indices are 0 or more, as nvidia-smi numbers them")
        if len(set(value)) != len(value):
            raise ValueError(f"each GPU may be listed once (got {value})")
        if info.data.get("nproc") is not None:
            raise ValueError("--gpus runs one process per listed GPU; drop --nproc")
        return value

    @field_validator("backend")
    @classmethod
    def _nccl_needs_gpus(cls, value: str, info: ValidationInfo) -> str:
        if value == "nccl" and not info.data.get("gpus"):
            raise ValueError("nccl runs on GPUs: list them with --gpus 0,1")
        return value

    @field_validator("sleeps", mode="before")
    @classmethod
    def _parse_sleeps(cls, value: Any) -> Any:
        return parse_float_list(value, "sleeps") if isinstance(value, str) else value

    @field_validator("sleeps")
    @classmethod
    def _one_sleep_per_rank(cls, value: list[float] | None, info: ValidationInfo):
        if value is None:
            return value
        if any(not 0 <= seconds <= 3600 for seconds in value):
            raise ValueError("sleeps are seconds, each between 0 and 3600")
        world_size = _world_size_so_far(info)
        if world_size is not None and len(value) != world_size:
            raise ValueError(
                f"give one value per rank: {len(value)} value(s) for {world_size} ranks "
                "(set the ranks with --nproc or --gpus)"
            )
        return value

    @field_validator("stagger")
    @classmethod
    def _stagger_or_sleeps(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and info.data.get("sleeps") is not None:
            raise ValueError("--stagger and --sleeps exclude each other; pick one")
        return value

    @field_validator("collective", mode="before")
    @classmethod
    def _parse_collectives(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part for part in value.replace(" ", "").replace("-", "_").split(",") if part]
        return value

    @field_validator("sizes", mode="before")
    @classmethod
    def _parse_sizes(cls, value: Any) -> Any:
        return parse_size_list(value, "sizes") if isinstance(value, str) else value

    @field_validator("sizes")
    @classmethod
    def _sizes_in_range(cls, value: list[int]) -> list[int]:
        if not value:
            raise ValueError("give at least one message size, e.g. 4,1K,1M,64M")
        if any(not 1 <= size <= MAX_MESSAGE_BYTES for size in value):
            raise ValueError("message sizes are 1 byte to 16G")
        return value

    @field_validator("skip_rank")
    @classmethod
    def _skip_rank_exists(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None:
            return value
        world_size = _world_size_so_far(info)
        if world_size is not None and world_size < 2:
            raise ValueError("a rank can only be missed by others: use 2 or more ranks")
        if world_size is not None and value >= world_size:
            raise ValueError(f"rank {value} does not exist: ranks are 0..{world_size - 1}")
        if info.data.get("demo", "staggered") != "staggered":
            raise ValueError("the skipped barrier is the staggered demo's: drop --demo")
        return value

    @property
    def world_size(self) -> int:
        return len(self.gpus) if self.gpus else (self.nproc or 2)

    @property
    def uses_gpus(self) -> bool:
        return bool(self.gpus)

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.uses_gpus else "gloo"

    @property
    def sleeps_per_rank(self) -> list[float]:
        """What each rank sleeps (staggered demo) or works (zero-first demo), in seconds."""
        if self.sleeps is not None:
            return list(self.sleeps)
        if self.stagger is None and self.demo == "zero-first":
            return [DEFAULT_WORK_S] * self.world_size
        stagger = DEFAULT_STAGGER_S if self.stagger is None else self.stagger
        return [stagger * rank for rank in range(self.world_size)]


def _world_size_so_far(info: ValidationInfo) -> int | None:
    """The rank count from fields validated before this one; None if they were invalid."""
    if "nproc" not in info.data or "gpus" not in info.data:
        return None
    gpus = info.data["gpus"]
    return len(gpus) if gpus else (info.data["nproc"] or 2)


def build_barrier_config(flags: dict[str, Any]) -> BarrierConfig:
    """Flags left at None mean "not given"."""
    try:
        return BarrierConfig(**{key: value for key, value in flags.items() if value is not None})
    except ValidationError as error:
        raise usage_error(describe_validation_error(error)) from None
