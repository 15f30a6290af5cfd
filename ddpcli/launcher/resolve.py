"""The checks and the resolutions `ddpcli.launcher.plan.plan_run` makes of a request against
this machine: every "auto" filled in, and what only the machine can tell checked before any
worker starts (GPUs that exist, data that is there, a model name that is known, an interface
that exists, a free init file).

Every refusal here is exit 2 with one line naming the flag: the run never started.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpcli.config import TrainConfig
from ddpcli.config.common import elastic_rendezvous
from ddpcli.config.plan import RunPlan
from ddpcli.config.train import JPEG_DATASETS, global_batch_of, scaled_lr
from ddpcli.data.layout import STL10_SIDE, check_data_source, resize_side, training_augment
from ddpcli.environments import LauncherEnv, check_meeting_place, left_aside
from ddpcli.environments.world import DEFAULT_MASTER_PORT, tcp_address
from ddpcli.errors import DdpcliError, usage_error
from ddpcli.files import folder_write_problem
from ddpcli.machine import (
    check_gpu_indices,
    check_interface,
    granted_gpus,
    nvidia_driver_version,
    physical_gpu_count,
)
from ddpcli.models.archs import check_arch
from ddpcli.outputs.runfolder import continues_after_requeue
from ddpcli.outputs.trackers import install_hint, missing_package
from ddpcli.outputs.trackers.probe import check_reachable, check_tracking_uri
from ddpcli.training.precision import auto_cpu_precision, native_cpu_bf16

# The side each data set is trained at unless --image-size says otherwise.
NATIVE_IMAGE_SIZE = {"synthetic": 32, "stl10": STL10_SIDE}
IMAGEFOLDER_SIZE = {"gpu": 224, "cpu": 64}


def tensorboard_installed() -> bool:
    return missing_package("tensorboard") is None


def check_tensorboard(cfg: TrainConfig) -> None:
    if "tensorboard" in cfg.trackers and not tensorboard_installed():
        flag = "--tensorboard" if cfg.tensorboard else "--tracker tensorboard"
        raise usage_error(
            f"invalid {flag}: the tensorboard package is not installed; "
            f"{install_hint('tensorboard')}, or drop {flag} (steps.jsonl and curves.png are "
            "written anyway)"
        )


def check_trackers(cfg: TrainConfig, launcher: LauncherEnv | None) -> None:
    """Each tracker's package is installed, MLflow's store is one it can open; with
    --tracker-strict, its server answers."""
    check_tensorboard(cfg)
    for name in cfg.tracker:
        package = missing_package(name)
        if package is not None and name != "tensorboard":
            raise usage_error(
                f"invalid --tracker {name}: the {package} package is not installed; "
                f"{install_hint(name)}, or drop {name} from --tracker"
            )
    check_tracking_uri(cfg)
    if cfg.tracker_strict and (launcher is None or launcher.rank == 0):
        check_reachable(cfg)


def checked_settings(
    cfg: TrainConfig, launcher: LauncherEnv | None, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The request's settings with every "auto" the flags and the disk can settle filled in,
    checked without torch (whose import takes seconds): a typo is answered at once.
    --precision auto stays for the plan's second stage (ddpcli.launcher.plan)."""
    values = cfg.model_dump()
    if launcher is None:
        resolve_devices(values)
    else:
        check_meeting_place(launcher, cfg.init_method)
        values["cpu"] = values["cpu"] or not launched_on_gpus()
    check_strategy(values, launcher)
    on_gpu = not values["cpu"]
    values["arch"] = values["arch"] or ("resnet18" if on_gpu else "smallcnn")
    check_arch(values["arch"])
    if values["image_size"] is None:
        folder_size = IMAGEFOLDER_SIZE["gpu" if on_gpu else "cpu"]
        values["image_size"] = NATIVE_IMAGE_SIZE.get(cfg.dataset, folder_size)
    values["augment"] = training_augment(cfg.augment, cfg.dataset)
    resolve_crop_sizes(values)
    values["out"] = values["out"] or default_out_dir()
    check_writable_folder(values["out"], "--out")
    if values["log_dir"] is not None:
        check_writable_folder(values["log_dir"], "--log-dir")
    resolve_agent_address(values)
    check_data_source(cfg)
    check_trackers(cfg, launcher)
    if cfg.ifname:
        check_interface(cfg.ifname)
    if launcher is None or launcher.rank == 0:
        check_init_file(cfg)
    values["world_from"] = world_origin(cfg, launcher)
    if continues_after_requeue(cfg.resume, values["out"], launcher, environ):
        values["resume"], values["overwrite"] = "auto", False  # a requeue never clears the run
    # The validators fill in what follows from the rest (--lr from the arch, the optimiser's
    # defaults): the settings as the plan holds them.
    resolved = TrainConfig(**values)
    world_size = launcher.world_size if launcher is not None else resolved.world_size
    check_ra_reps(resolved.ra_reps, world_size)
    settled = {**resolved.model_dump(), **planned_batch(resolved, world_size)}
    settled["decode"], settled["decode_reason"] = planned_decode(resolved, not resolved.cpu)
    # What --dry-run shows; every rank settles it again from the world it joined.
    global_batch = global_batch_of(settled["per_gpu_batch"], world_size, settled["accumulate"])
    peak_lr = scaled_lr(settled["lr"], global_batch, resolved.lr_base_batch, settled["lr_scaling"])
    return {**settled, "peak_lr": peak_lr}


def planned_batch(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """--global-batch shared out: the --accumulate that makes it of --per-gpu-batch; with
    --per-gpu-batch auto, each process's share of it (which each rank runs in micro-batches
    that fit its device). A global batch the world cannot share evenly is refused, with the
    nearest that it can."""
    per_process = world_size if cfg.per_gpu_batch == "auto" else cfg.per_gpu_batch * world_size
    wanted = cfg.global_batch or cfg.global_batch_at(world_size)
    if wanted % per_process:
        lower = max(per_process, wanted // per_process * per_process)
        unit = "ranks" if cfg.per_gpu_batch == "auto" else f"ranks of {cfg.per_gpu_batch} images"
        raise usage_error(
            f"invalid --global-batch: {wanted} images cannot be shared by {world_size} {unit}; "
            f"give a multiple of {per_process}, such as {lower} or {lower + per_process}"
        )
    if cfg.per_gpu_batch == "auto":
        return {"per_gpu_batch": wanted // world_size, "accumulate": 1, "batch_auto": True}
    if cfg.global_batch is None:
        return {}
    accumulate = wanted // per_process
    if cfg.accumulate not in (1, accumulate):
        raise usage_error(
            f"invalid --accumulate: {cfg.accumulate} with --per-gpu-batch {cfg.per_gpu_batch} "
            f"on {world_size} ranks makes a global batch of "
            f"{cfg.per_gpu_batch * world_size * cfg.accumulate}, not --global-batch {wanted}; "
            "drop one of them"
        )
    return {"accumulate": accumulate}


def resolve_crop_sizes(values: dict[str, Any]) -> None:
    """FixRes' sizes (train at one side, validate at another), from --image-size by default:
    validation resizes image folders to crop / 0.875 (256 for 224) as the references do."""
    image_size = values["image_size"]
    values["train_crop_size"] = values["train_crop_size"] or image_size
    crop = values["val_crop_size"] = values["val_crop_size"] or image_size
    folder = values["dataset"] == "imagefolder"
    photos = folder or values["dataset"] == "shards"  # validated as torchvision's references do
    values["val_resize_size"] = values["val_resize_size"] or (resize_side(crop) if photos else crop)
    if values["train_crop_size"] != image_size and values["augment"] != "rrc":
        raise usage_error(
            f"invalid --train-crop-size: it is the side of --augment rrc's random-resized crop; "
            f"with --augment {values['augment']} training sees --image-size {image_size}: use "
            "--augment rrc, or set --image-size instead"
        )
    if crop > values["val_resize_size"]:
        raise usage_error(
            f"invalid --val-crop-size: {crop} is larger than --val-resize-size "
            f"{values['val_resize_size']}; the crop is cut from the resized image"
        )
    default_view = (resize_side(image_size), image_size)
    view = (values["val_resize_size"], crop)
    if folder and values["data_path"] == "device" and view != default_view:
        raise usage_error(
            "invalid --val-resize-size/--val-crop-size: the device path caches image folders' "
            f"validation view at --image-size {image_size} (resize {default_view[0]}, crop "
            f"{image_size}); use --data-path loader for other validation sizes"
        )


def check_ra_reps(ra_reps: int, world_size: int) -> None:
    """Repeated augmentation shows each image on --ra-reps different ranks: it needs them."""
    if ra_reps > world_size:
        raise usage_error(
            f"invalid --ra-reps: {ra_reps} copies of each image go to {ra_reps} different ranks, "
            f"but the world has {world_size}; lower --ra-reps to {world_size} or add processes"
        )


def world_origin(cfg: TrainConfig, launcher: LauncherEnv | None) -> str:
    """Where the world came from, in words, for the run's header."""
    if launcher is not None:
        return launcher.describe()
    where = cfg.world_from or "the command line"
    if unused := left_aside():
        where = f"{where}; {unused}"
    if cfg.elastic:
        host, port = cfg.rendezvous_address(DEFAULT_MASTER_PORT)
        nodes = f"{cfg.min_nnodes or cfg.nnodes}:{cfg.nnodes}"
        return f"{where}; c10d rendezvous of {nodes} nodes at {host}:{port}"
    return where


# The oldest Linux driver each CUDA major version runs on (CUDA's minor version compatibility).
MINIMUM_DRIVER = {11: 450, 12: 525, 13: 580}


def check_usable_gpus(cfg: TrainConfig) -> None:
    """A run on GPUs that torch cannot use is refused here: its workers would each fall back
    to the CPU unseen (an 8-GPU node training as 8 Gloo processes)."""
    if not cfg.cpu:
        check_torch_sees_gpus(len(cfg.gpus or []), on_the_cpu="pass --cpu to run on the CPU")


def launched_on_gpus() -> bool:
    """Under a launcher (torchrun, srun): whether this rank trains on a GPU. The CPU when
    there is none; exit 2 when nvidia-smi lists GPUs (that this shell may use) torch cannot."""
    import torch

    if torch.cuda.is_available():
        return True
    count = physical_gpu_count()
    try:
        granted = granted_gpus(count) if count else []
    except DdpcliError:  # entries only CUDA reads (MIG slices): the GPUs are there
        granted = None
    gpus = count if granted is None else len(granted)
    check_torch_sees_gpus(gpus, on_the_cpu="pass --cpu to run on the CPU")
    return False


def check_torch_sees_gpus(gpus: int, on_the_cpu: str) -> None:
    """GPUS were asked for, or nvidia-smi lists them: exit 2 if torch cannot use them, naming
    torch's CUDA and the driver's version. `on_the_cpu` says how to run the command without."""
    if gpus == 0:
        return
    import torch

    if torch.cuda.is_available():
        return
    problem, fix = gpus_torch_cannot_use(
        torch.__version__, torch.version.cuda, nvidia_driver_version(), gpus
    )
    raise usage_error(f"{problem}; {fix}, or {on_the_cpu}")


def gpus_torch_cannot_use(
    torch_version: str, cuda: str | None, driver: str | None, gpus: int
) -> tuple[str, str]:
    """What is wrong, and what to do, when torch cannot use the GPUS nvidia-smi lists: the
    words of the refusal above and of check-env's CUDA row."""
    if not cuda:
        return (
            f"torch {torch_version} is a CPU-only build, but nvidia-smi lists {gpus} GPU(s)",
            "install a CUDA build of torch (pytorch.org/get-started)",
        )
    driver_text = f"driver {driver}" if driver else "a driver nvidia-smi does not name"
    problem = (
        f"torch {torch_version} (CUDA {cuda}) cannot use the {gpus} GPU(s) nvidia-smi lists "
        f"with {driver_text}"
    )
    cuda_major = int(cuda.split(".")[0])
    needed = MINIMUM_DRIVER.get(cuda_major)
    if needed is not None and driver and driver_major(driver) < needed:
        return (
            f"{problem}: CUDA {cuda_major} needs driver {needed} or newer",
            f"install a driver of {needed} or newer, or a torch build for an older CUDA "
            "(pytorch.org/get-started/previous-versions)",
        )
    return (
        problem,
        f"check that this process may reach the GPUs (/dev/nvidia*, a container's GPU access) "
        f"and that the driver supports CUDA {cuda}",
    )


def driver_major(driver: str) -> int:
    """535 for "535.104.05"; 0 when nvidia-smi's answer is not a version."""
    head = driver.split(".")[0]
    return int(head) if head.isdigit() else 0


def planned_decode(cfg: TrainConfig, on_gpu: bool) -> tuple[str, str | None]:
    """`--decode auto`: on the rank's GPU (nvjpeg) where training reads JPEG files or shards;
    on the CPU the loader workers decode, in parallel, at the scale each crop needs."""
    if cfg.decode != "auto":
        return cfg.decode, None
    if cfg.dataset not in JPEG_DATASETS or cfg.data_path == "device":
        return "cpu", "auto: training reads no JPEG files"
    if not on_gpu:
        return "cpu", "auto: a CPU run, whose loader workers decode in parallel"
    return "gpu", "auto: a GPU run reading JPEGs"


def checked_decoder(plan: RunPlan) -> tuple[str, str | None]:
    """--decode gpu where this torchvision has the rank's decoder (nvjpeg on GPUs); `auto`
    falls back to the workers' decode without it, a --decode gpu asked for is exit 2."""
    from ddpcli.data.encoded import device_decoder_missing

    if plan.decode != "gpu":
        return plan.decode, plan.decode_reason
    missing = device_decoder_missing("cpu" if plan.cpu else "cuda")
    if missing is None:
        return plan.decode, plan.decode_reason
    if plan.decode_reason is not None:  # auto chose it
        return "cpu", f"auto: {missing}"
    raise usage_error(
        f"invalid --decode: gpu needs the rank's JPEG decoder: {missing}; use --decode cpu"
    )


def planned_precision(plan: RunPlan) -> tuple[str, str | None]:
    """`--precision auto` on the CPU (ddpcli.training.precision: native bf16 and a model it pays
    for), asked of torch, and why. On GPUs each rank decides from the device it is given."""
    if not plan.cpu or plan.precision != "auto":
        return plan.precision, plan.precision_reason
    return auto_cpu_precision(plan.arch, native_cpu_bf16())


def default_out_dir() -> Path:
    return Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def check_writable_folder(path: Path, flag: str) -> None:
    """PATH is a folder this process can write in, or can create: else exit 2 naming FLAG.
    Nothing is created here (a dry run writes nothing)."""
    problem = folder_write_problem(path)
    if problem:
        raise usage_error(f"invalid {flag}: cannot write in {path}: {problem}; give a folder")


def resolve_devices(values: dict[str, Any]) -> None:
    """No --gpus: the GPUs CUDA_VISIBLE_DEVICES grants when it is set, else every GPU
    nvidia-smi lists; the CPU when that leaves none."""
    if values["cpu"]:
        values["nproc"] = values["nproc"] or 2
        return
    if values["gpus"] is None:
        count = physical_gpu_count()
        granted = granted_gpus(count) if count else []  # a CPU machine may carry it too
        gpus = list(range(count)) if granted is None else granted
        if gpus:
            values["gpus"] = gpus
        else:
            values["cpu"], values["nproc"] = True, values["nproc"] or 2
        return
    check_gpu_indices(values["gpus"], cpu_alternative="--cpu")


def check_strategy(values: dict[str, Any], launcher: LauncherEnv | None) -> None:
    """dp and balanced-dp are one process driving two or more GPUs of one machine."""
    strategy = values["strategy"]
    if strategy == "ddp":
        return
    if (launcher is not None and launcher.world_size > 1) or values["nnodes"] > 1:
        raise usage_error(
            f"invalid --strategy: {strategy} is a single process on one machine; for several "
            "processes or nodes use --strategy ddp (the default)"
        )
    gpus = single_process_gpu_count(values, launcher)
    if gpus < 2:
        have = "is on the CPU" if values["cpu"] else f"has {gpus} GPU"
        raise usage_error(
            f"invalid --strategy: {strategy} is one process driving 2 or more GPUs, but this "
            f"run {have}; use --strategy ddp (the default), or list GPUs with --gpus 0,1"
        )
    batch, gpu0_batch = values["per_gpu_batch"], values["gpu0_batch"]
    if strategy == "balanced-dp" and batch - gpu0_batch < gpus - 1:
        raise usage_error(
            f"invalid --gpu0-batch: {gpu0_batch} of a batch of {batch} leaves less than one "
            f"sample for each of the other {gpus - 1} GPUs; lower it or raise --per-gpu-batch"
        )


def single_process_gpu_count(values: dict[str, Any], launcher: LauncherEnv | None) -> int:
    if values["cpu"]:
        return 0
    if launcher is not None:
        import torch

        return torch.cuda.device_count()
    return len(values["gpus"])


def resolve_agent_address(values: dict[str, Any]) -> None:
    """Where the node agents meet: --master-addr:--master-port (29500 on several nodes).
    With tcp://HOST:PORT the workers' process group listens on PORT itself, so the agents
    default to HOST and PORT+1: two ports, derived the same way on every node."""
    method = values["init_method"] or ""
    if cfg_is_elastic(values) and method:
        raise usage_error(
            "invalid --init-method: with --nnodes MIN:MAX the c10d rendezvous decides who "
            "the workers meet; leave --init-method out"
        )
    if not method.startswith("tcp://"):
        if values["nnodes"] > 1 and values["master_port"] is None:
            values["master_port"] = DEFAULT_MASTER_PORT
        return
    host, port = tcp_address(method)
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


def cfg_is_elastic(values: dict[str, Any]) -> bool:
    return elastic_rendezvous(values["min_nnodes"], values["nnodes"], values["rdzv_backend"])


def check_init_file(cfg: TrainConfig) -> None:
    """file:// init on a file an earlier run left: the new run would hang or fail."""
    method = cfg.init_method or ""
    if not method.startswith("file://") or cfg.node_rank != 0:
        return
    path = Path(method.removeprefix("file://"))
    if path.exists():
        raise usage_error(
            f"invalid --init-method: {path} already exists, probably left by an earlier run; "
            f"if no run is using it, delete it (rm {path}) or give a new file name"
        )
    if not path.parent.is_dir():
        raise usage_error(f"invalid --init-method: folder {path.parent} does not exist")
