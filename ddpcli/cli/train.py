"""`ddpcli train`: flags and a recipe -> one validated TrainConfig -> the launcher."""

from __future__ import annotations

import contextlib
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ddpcli import ui
from ddpcli.cli.app import _state, app, run_command
from ddpcli.cli.options import option, setting
from ddpcli.config import TrainConfig
from ddpcli.environments import LauncherEnv
from ddpcli.errors import INTERRUPTED, RUNTIME, DdpcliError

# --- train ----------------------------------------------------------------------------------

DATA = "Data"
MODEL = "Model and optimisation"
PROCS = "Processes and devices"
NODES = "Multi-node"
OUTPUT = "Outputs and checkpoints"
RECIPE = "Recipe ingredients (docs/train.md)"


def train_option(
    name: str,
    help: str | None = None,
    panel: str | None = None,
    default: str | None = None,
    metavar: str | None = None,
) -> Any:
    """`--NAME` for TrainConfig's field NAME: help shows its default (or DEFAULT, in words)."""
    return setting(TrainConfig, name, help, panel=panel, default=default, metavar=metavar)


@app.command(no_args_is_help=False)
def train(
    recipe: Annotated[
        Path | None, option("TOML recipe; flags override it.", default="none")
    ] = None,
    dataset: Annotated[
        str | None,
        train_option(
            "dataset",
            "Images to train on (stl10, imagefolder: --data-dir), or your own: a factory "
            "called with data_dir= and image_size=, returning (train, val, class_names) "
            "(docs/custom.md).",
            DATA,
            metavar="[synthetic|stl10|imagefolder|pkg.module:factory]",
        ),
    ] = None,
    data_dir: Annotated[
        Path | None, train_option("data_dir", "Data folder.", DATA, default="none")
    ] = None,
    download: Annotated[
        bool | None, train_option("download", "Fetch STL-10 on rank 0 first.", DATA)
    ] = None,
    image_size: Annotated[
        int | None,
        train_option(
            "image_size",
            "Side in px.",
            DATA,
            default="32 synthetic, 96 stl10, 224 imagefolder (64 on the CPU)",
        ),
    ] = None,
    synthetic_size: Annotated[int | None, train_option("synthetic_size", panel=DATA)] = None,
    data_path: Annotated[
        str | None,
        train_option(
            "data_path",
            "device: the uint8 set in device memory, augmented there; loader: DataLoader "
            "workers; auto: device for synthetic/stl10 when the set takes at most a quarter "
            "of free device memory.",
            DATA,
        ),
    ] = None,
    workers: Annotated[
        int | None,
        train_option("workers", panel=DATA, default="CPU cores per local rank - 1, at most 8"),
    ] = None,
    skip_bad_images: Annotated[bool | None, train_option("skip_bad_images", panel=DATA)] = None,
    augment: Annotated[
        str | None,
        train_option(
            "augment",
            "Training augmentation. rrc: random-resized crop (area 8-100%, aspect 3/4-4/3) "
            "and flip; crop-flip: 4 px padded crop and flip; none. auto: rrc for image "
            "folders, crop-flip for synthetic/stl10. Validation is the same for all.",
            DATA,
        ),
    ] = None,
    arch: Annotated[
        str | None,
        train_option(
            "arch",
            "torchvision model name, smallcnn/tinycnn, timm:NAME (needs timm), or your own "
            "model: pkg.module:factory, pkg.module.factory or path/to/file.py:factory, called "
            "with num_classes= and the --model-arg keywords (docs/custom.md).",
            MODEL,
            default="resnet18 on GPUs, smallcnn on the CPU",
        ),
    ] = None,
    model_args: Annotated[
        list[str] | None,
        option(
            "KEY=VALUE passed to the model's constructor; VALUE is read as TOML (4, 0.5, "
            "true, [1,2]), else as a string. Repeatable.",
            panel=MODEL,
            default="none",
            metavar="KEY=VALUE",
            decls=("--model-arg",),
        ),
    ] = None,
    init_from: Annotated[
        Path | None,
        train_option(
            "init_from",
            "Start from these weights: a ddpcli checkpoint, a `ddpcli checkpoint convert` "
            "output or a torch.save'd state dict. Not a resume: step, optimiser and schedule "
            "start fresh.",
            MODEL,
            default="none: the model's own initialisation",
        ),
    ] = None,
    reset_head: Annotated[bool | None, train_option("reset_head", panel=MODEL)] = None,
    epochs: Annotated[int | None, train_option("epochs", panel=MODEL)] = None,
    per_gpu_batch: Annotated[
        int | None, train_option("per_gpu_batch", "Batch of one process.", MODEL)
    ] = None,
    accumulate: Annotated[
        int | None, train_option("accumulate", "Micro-batches per optimizer step.", MODEL)
    ] = None,
    lr: Annotated[
        float | None,
        train_option(
            "lr",
            "Peak learning rate for a global batch of --lr-base-batch images.",
            MODEL,
            default="sgd 0.1 (0.2 for smallcnn/tinycnn); adamw 0.001",
        ),
    ] = None,
    lr_base_batch: Annotated[
        int | None, train_option("lr_base_batch", "The global batch --lr is meant for.", MODEL)
    ] = None,
    lr_scaling: Annotated[
        str | None,
        train_option(
            "lr_scaling",
            "How --lr follows the global batch (per-gpu-batch x world x accumulate): linear "
            "multiplies it by global/base, sqrt by the square root of that; none: --lr as given.",
            MODEL,
            default="linear for sgd, sqrt for adamw",
        ),
    ] = None,
    optimizer: Annotated[
        str | None,
        train_option(
            "optimizer",
            "sgd: Nesterov momentum; adamw: decoupled weight decay. Each brings its own "
            "--lr, --lr-scaling and --weight-decay defaults.",
            MODEL,
        ),
    ] = None,
    momentum: Annotated[
        float | None, train_option("momentum", "SGD's.", MODEL, default="0.9 with sgd")
    ] = None,
    betas: Annotated[
        str | None,
        train_option("betas", "AdamW's, as B1,B2.", MODEL, default="0.9,0.999 with adamw"),
    ] = None,
    weight_decay: Annotated[
        float | None,
        train_option(
            "weight_decay", "Not on norms and biases.", MODEL, default="0.0005 sgd, 0.05 adamw"
        ),
    ] = None,
    warmup_epochs: Annotated[float | None, train_option("warmup_epochs", panel=MODEL)] = None,
    label_smoothing: Annotated[float | None, train_option("label_smoothing", panel=MODEL)] = None,
    seed: Annotated[int | None, train_option("seed", panel=MODEL)] = None,
    precision: Annotated[
        str | None,
        train_option(
            "precision",
            "auto: bf16 on GPUs that have it, and on CPUs with native bf16 (AVX512_BF16, "
            "AMX) for models of dense convolutions and matmuls; else fp32. The header says why.",
            MODEL,
        ),
    ] = None,
    compile: Annotated[
        bool | None, train_option("compile", "torch.compile the model.", MODEL)
    ] = None,
    max_steps: Annotated[
        int | None,
        train_option("max_steps", "Stop after N optimizer steps.", MODEL, default="no limit"),
    ] = None,
    gpus: Annotated[
        str | None,
        train_option(
            "gpus",
            "Physical GPU indices, one process each: 0,3.",
            PROCS,
            default="all GPUs, else 2 CPU processes",
        ),
    ] = None,
    cpu: Annotated[bool | None, train_option("cpu", "Gloo processes on the CPU.", PROCS)] = None,
    nproc: Annotated[
        int | None,
        train_option("nproc", "Processes per node on the CPU.", PROCS, default="2"),
    ] = None,
    backend: Annotated[
        str | None, train_option("backend", "auto: nccl on GPUs, gloo on the CPU.", PROCS)
    ] = None,
    strategy: Annotated[
        str | None,
        train_option(
            "strategy", "ddp: one process per device; dp, balanced-dp: nn.DataParallel.", PROCS
        ),
    ] = None,
    gpu0_batch: Annotated[
        int | None,
        train_option(
            "gpu0_batch",
            "balanced-dp: GPU 0's share of each --per-gpu-batch batch (2 of 8 on three "
            "GPUs: 2+3+3).",
            PROCS,
            default="none",
        ),
    ] = None,
    bucket_cap_mb: Annotated[float | None, train_option("bucket_cap_mb", panel=PROCS)] = None,
    find_unused_parameters: Annotated[
        bool | None, train_option("find_unused_parameters", panel=PROCS)
    ] = None,
    nnodes: Annotated[
        str | None,
        train_option(
            "nnodes",
            "Nodes: N, or MIN:MAX to run on as many as come (c10d rendezvous, the same "
            "command on every host, no --node-rank; a lost host leaves a smaller world).",
            NODES,
        ),
    ] = None,
    node_rank: Annotated[int | None, train_option("node_rank", panel=NODES)] = None,
    master_addr: Annotated[str | None, train_option("master_addr", panel=NODES)] = None,
    master_port: Annotated[
        int | None,
        train_option("master_port", panel=NODES, default="a free port; 29500 on several nodes"),
    ] = None,
    rdzv_backend: Annotated[
        str | None,
        train_option(
            "rdzv_backend",
            "How the nodes meet: static (fixed --node-rank) or c10d (any order, no ranks).",
            NODES,
            default="c10d for --nnodes MIN:MAX, else static",
        ),
    ] = None,
    rdzv_endpoint: Annotated[
        str | None,
        train_option(
            "rdzv_endpoint",
            "HOST[:PORT] where the nodes meet; the host that holds this address serves it.",
            NODES,
            default="--master-addr:--master-port",
        ),
    ] = None,
    rdzv_id: Annotated[
        str | None,
        train_option("rdzv_id", "The job's name in the rendezvous.", NODES, default="ddpcli"),
    ] = None,
    init_method: Annotated[
        str | None,
        train_option(
            "init_method", "env:// | tcp://HOST:PORT | file:///PATH.", NODES, default="env://"
        ),
    ] = None,
    ifname: Annotated[
        str | None,
        train_option(
            "ifname", "Network interface for Gloo/NCCL.", NODES, default="the one Gloo/NCCL pick"
        ),
    ] = None,
    timeout: Annotated[float | None, train_option("timeout", panel=NODES)] = None,
    max_restarts: Annotated[int | None, train_option("max_restarts", panel=NODES)] = None,
    out: Annotated[
        Path | None, train_option("out", "Output folder.", OUTPUT, default="runs/<time>")
    ] = None,
    resume: Annotated[
        str | None,
        train_option(
            "resume",
            "PATH or auto (OUT/checkpoints/last.pt).",
            OUTPUT,
            default="none: a fresh start",
        ),
    ] = None,
    overwrite: Annotated[
        bool | None,
        train_option(
            "overwrite",
            "Clear an earlier run's metrics and checkpoints from --out first.",
            OUTPUT,
        ),
    ] = None,
    save_every_steps: Annotated[
        int | None,
        train_option(
            "save_every_steps",
            "Also checkpoint every N steps.",
            OUTPUT,
            default="at epoch ends only",
        ),
    ] = None,
    keep_last: Annotated[
        int | None, train_option("keep_last", "Epoch/step checkpoints to keep.", OUTPUT)
    ] = None,
    log_dir: Annotated[
        Path | None,
        train_option("log_dir", "One log file per rank.", OUTPUT, default="none: the terminal"),
    ] = None,
    log_every: Annotated[int | None, train_option("log_every", panel=OUTPUT)] = None,
    tensorboard: Annotated[bool | None, train_option("tensorboard", panel=OUTPUT)] = None,
    preempt_signal: Annotated[
        str | None,
        train_option(
            "preempt_signal",
            "A scheduler's warning (SLURM: --signal=USR1@90), sent to the launcher or any "
            "rank: all ranks save a checkpoint within --log-every steps and stop (exit 1).",
            OUTPUT,
        ),
    ] = None,
    sync_bn: Annotated[bool | None, train_option("sync_bn", panel=RECIPE)] = None,
    ema: Annotated[bool | None, train_option("ema", panel=RECIPE)] = None,
    ema_decay: Annotated[
        float | None,
        train_option(
            "ema_decay",
            "EMA decay, adjusted as torchvision's reference does: 1 - (1 - F) x global batch x "
            "--ema-steps / --epochs.",
            RECIPE,
        ),
    ] = None,
    ema_steps: Annotated[int | None, train_option("ema_steps", panel=RECIPE)] = None,
    mixup_alpha: Annotated[float | None, train_option("mixup_alpha", panel=RECIPE)] = None,
    cutmix_alpha: Annotated[
        float | None,
        train_option(
            "cutmix_alpha",
            "CutMix's Beta(alpha, alpha); 0: off. With --mixup-alpha too, one of the two per "
            "batch; the loss takes the mixed (soft) targets.",
            RECIPE,
        ),
    ] = None,
    auto_augment: Annotated[str | None, train_option("auto_augment", panel=RECIPE)] = None,
    random_erase: Annotated[float | None, train_option("random_erase", panel=RECIPE)] = None,
    ra_reps: Annotated[int | None, train_option("ra_reps", panel=RECIPE)] = None,
    train_crop_size: Annotated[
        int | None,
        train_option(
            "train_crop_size",
            "Side of the random-resized crop that training sees (--augment rrc).",
            RECIPE,
            default="--image-size",
        ),
    ] = None,
    val_resize_size: Annotated[
        int | None,
        train_option(
            "val_resize_size",
            "Validation: shorter side resized to N, then the centre crop.",
            RECIPE,
            default="--val-crop-size / 0.875 for image folders; the crop for synthetic/stl10",
        ),
    ] = None,
    val_crop_size: Annotated[
        int | None,
        train_option("val_crop_size", "Validation's centre crop.", RECIPE, default="--image-size"),
    ] = None,
    norm_weight_decay: Annotated[
        float | None, train_option("norm_weight_decay", panel=RECIPE)
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the resolved config and exit.")
    ] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Train a model with DistributedDataParallel.

    One process per GPU, or Gloo processes on the CPU; on one machine or several.
    Settings come from the defaults, then a --recipe, then flags."""
    flags = {
        key: value
        for key, value in locals().items()
        if key not in ("recipe", "dry_run", "json_output")
    }
    if not model_args:  # Typer gives [] for a repeatable flag not given: a recipe's stands
        flags["model_args"] = None

    def action() -> None:
        from ddpcli.config import build_train_config
        from ddpcli.environments import read_launcher_env
        from ddpcli.launcher.launch import early_fork_server

        launcher = read_launcher_env()
        cfg = checked(build_train_config(flags, recipe), launcher)
        # CPU workers: their fork server imports torch beside us (ddpcli.launcher.fork).
        with contextlib.nullcontext() if dry_run else early_fork_server(cfg, launcher):
            launched = resolve_and_launch(cfg, launcher)
        if launched is None:
            return
        cfg, summary = launched
        if summary.get("stopped"):
            stopped = stopped_early(summary)
            if launcher is not None and launcher.rank != 0:  # torchrun's ranks: rank 0 says it
                raise SystemExit(stopped.exit_code)
            raise stopped
        report_training(cfg, summary, json_output)

    def checked(cfg: TrainConfig, launcher: LauncherEnv | None) -> TrainConfig:
        """The run checked against the flags and the disk, before torch is imported: a typo
        costs nothing. An error names where each setting it names came from."""
        from ddpcli.config.train import train_setting_origins, with_origins
        from ddpcli.errors import DdpcliError
        from ddpcli.launcher.resolve import checked_train_config

        try:
            return checked_train_config(cfg, launcher)
        except DdpcliError as error:
            raise with_origins(error, train_setting_origins(flags, recipe)) from None

    def resolve_and_launch(
        cfg: TrainConfig, launcher: LauncherEnv | None
    ) -> tuple[TrainConfig, dict[str, Any]] | None:
        """Resolve what needs torch, check the rest, then launch: the run's config and rank
        0's summary (None for a dry run, shown)."""
        from ddpcli.launcher.resolve import with_cpu_precision, with_usable_gpus
        from ddpcli.training.preflight import preflight

        cfg = with_cpu_precision(with_usable_gpus(cfg))

        built = preflight(cfg)  # the user's own code runs here first: exit 2 before workers
        if dry_run:
            show_config(cfg, json_output, built)
            return None
        from ddpcli.checkpoint.schema import check_resume_source
        from ddpcli.launcher.launch import launch_train
        from ddpcli.runs.runfolder import continue_after_requeue

        cfg = continue_after_requeue(cfg, launcher)
        check_resume_source(cfg)  # a bad --resume file: exit 2 now, before any worker starts
        try:
            return cfg, launch_train(cfg, debug=_state["debug"])
        except KeyboardInterrupt as stop:  # under torchrun this process was the rank itself
            record = getattr(stop, "record", None)  # ddpcli.training.stopping.Interrupted's
            if record is None:
                raise
            return cfg, record

    run_command(action)


def resume_command(out: str, argv: list[str] | None = None) -> str:
    """This command again, continuing the run in OUT: `--resume auto` in place of any
    --resume or --overwrite, and --out named (its default is a new folder each time)."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept: list[str] = []
    skip_value = False
    for arg in args:
        if skip_value:
            skip_value = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--resume", "--out") and "=" not in arg:
            skip_value = True
            continue
        if name in ("--resume", "--out", "--overwrite", "--no-overwrite"):
            continue
        kept.append(arg)
    return "ddpcli " + shlex.join([*kept, "--out", out, "--resume", "auto"])


def stopped_early(summary: dict) -> DdpcliError:
    """Ctrl-C: exit 130; a preemption or a termination: exit 1. One line: where, what was
    saved, what next."""
    where = f"epoch {summary['stopped_epoch']} step {summary['stopped_step']}"
    resume = resume_command(summary["out"])
    saved = summary.get("last_checkpoint")
    if saved and summary.get("checkpoint_at"):
        saved = f"{saved} ({summary['checkpoint_at']})"
    checkpoint = f"last checkpoint: {saved}" if saved else "no checkpoint saved yet"
    if summary["stopped"] == "interrupted":
        return DdpcliError(f"interrupted at {where}; {checkpoint}; resume: {resume}", INTERRUPTED)
    if summary["stopped"] == "terminated":  # SIGTERM, with --preempt-signal USR1
        preempt = summary["preempt_signal"].removeprefix("SIG")
        return DdpcliError(
            f"terminated at {where} by SIGTERM, not the preemption signal (--preempt-signal "
            f"{preempt}); {checkpoint}; resume: {resume}",
            RUNTIME,
        )
    return DdpcliError(
        f"preempted at {where}: saved {saved}; resume: {resume} (a job requeued with the same "
        "--out resumes by itself)",
        RUNTIME,
    )


def show_config(cfg, json_output: bool, built: dict | None = None) -> None:
    document = cfg.model_dump(mode="json")
    document.update(world_size=cfg.world_size, global_batch=cfg.global_batch, **(built or {}))
    if json_output:
        ui.print_json(document)
        return
    for key, value in document.items():
        typer.echo(f"{key} = {value}")


def resource_line(cfg, summary: dict) -> str:
    """What the run cost: images/s for the strategy that ran, and peak memory per device."""
    line = f"strategy {cfg.strategy}: {ui.rate_of(summary)}"
    if summary.get("peak_memory_mb"):
        label = "per GPU" if cfg.strategy != "ddp" else "per GPU (by rank)"
        peaks = ", ".join(f"{i}: {mb:.0f}" for i, mb in enumerate(summary["peak_memory_mb"]))
        return f"{line} · peak GPU memory allocated {label}, MB: {peaks}"
    if summary.get("peak_rss_mb"):
        peaks = ", ".join(f"{i}: {mb:.0f}" for i, mb in enumerate(summary["peak_rss_mb"]))
        return f"{line} · no GPU; peak host memory (RSS) per rank, MB: {peaks}"
    return line


def report_rank_load(cfg, summary: dict) -> None:
    """The last epoch's data wait and compute per rank; the straggler named, with a hint."""
    from ddpcli.training.rankload import straggler_note

    if "data_wait_frac_per_rank" not in summary:
        return
    waits = ", ".join(
        f"{i}: {100 * f:.0f}%" for i, f in enumerate(summary["data_wait_frac_per_rank"])
    )
    computes = ", ".join(f"{i}: {ms:.1f}" for i, ms in enumerate(summary["compute_ms_per_rank"]))
    ui.info(
        f"data wait {100 * summary['data_wait_frac']:.0f}% of the step (per rank: {waits}) · "
        f"compute per step, ms: {computes}"
    )
    if note := straggler_note(summary):
        ui.warn(note)


def report_training(cfg, summary: dict, json_output: bool) -> None:
    from ddpcli.environments import read_launcher_env

    launcher = read_launcher_env()
    if launcher is not None and launcher.rank != 0:
        return
    if json_output:
        ui.print_json(summary)
        return
    if summary.get("node_rank", 0) != 0:
        ui.info(f"node {summary['node_rank']} finished; node 0 (rank 0) writes the outputs")
        return
    if "val_acc" in summary:
        ui.info(f"done: {ui.format_metrics(summary)}")
        ui.info(resource_line(cfg, summary))
        report_rank_load(cfg, summary)
    if summary.get("skipped_images"):
        ui.warn(
            f"--skip-bad-images left out {summary['skipped_images']} image(s) that cannot be "
            f"decoded: listed in {summary['skipped_images_file']}"
        )
    ui.info(
        f"outputs in {summary.get('out')}: metrics.jsonl, steps.jsonl, config.json, "
        "checkpoints/last.pt, best.pt"
    )
    if summary.get("curves"):
        ui.info(f"curves: {summary['curves']} (compare runs: ddpcli plot RUN_DIR RUN_DIR ...)")
    if cfg.cpu:
        ui.info(
            "to scale up: `ddpcli train --gpus 0,1 --recipe recipes/stl10-resnet18.toml` on a GPU "
            "machine, or add --nnodes/--node-rank/--master-addr to span machines (docs/train.md)"
        )
