"""`ddpcli train`: flags and a recipe -> one validated TrainConfig -> the launcher.

The options are declared in ddpcli.cli.train_options, one module per help panel; the
signature below names them, panel by panel, in the order help shows them.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
from pathlib import Path
from typing import Any

import typer

from ddpcli import ui
from ddpcli.cli.app import _state, app, run_command
from ddpcli.cli.train_options import (
    command,
    data,
    ingredients,
    model,
    nodes,
    outputs,
    processes,
)
from ddpcli.config import TrainConfig
from ddpcli.environments import LauncherEnv
from ddpcli.errors import INTERRUPTED, RUNTIME, DdpcliError

COMMAND_OWN = ("recipe", "dry_run", "json_output")  # the command's options, not settings


@app.command(no_args_is_help=False)
def train(
    recipe: command.Recipe = None,
    # Data
    dataset: data.Dataset = None,
    data_dir: data.DataDir = None,
    download: data.Download = None,
    image_size: data.ImageSize = None,
    synthetic_size: data.SyntheticSize = None,
    data_path: data.DataPath = None,
    workers: data.Workers = None,
    skip_bad_images: data.SkipBadImages = None,
    shuffle_buffer: data.ShuffleBuffer = None,
    augment: data.Augment = None,
    # Model and optimisation
    arch: model.Arch = None,
    model_args: model.ModelArgs = None,
    init_from: model.InitFrom = None,
    reset_head: model.ResetHead = None,
    epochs: model.Epochs = None,
    per_gpu_batch: model.PerGpuBatch = None,
    accumulate: model.Accumulate = None,
    lr: model.Lr = None,
    lr_base_batch: model.LrBaseBatch = None,
    lr_scaling: model.LrScaling = None,
    optimizer: model.Optimizer = None,
    momentum: model.Momentum = None,
    betas: model.Betas = None,
    weight_decay: model.WeightDecay = None,
    warmup_epochs: model.WarmupEpochs = None,
    label_smoothing: model.LabelSmoothing = None,
    seed: model.Seed = None,
    precision: model.Precision = None,
    compile: model.Compile = None,
    max_steps: model.MaxSteps = None,
    # Processes and devices
    gpus: processes.Gpus = None,
    cpu: processes.Cpu = None,
    nproc: processes.Nproc = None,
    backend: processes.Backend = None,
    strategy: processes.Strategy = None,
    gpu0_batch: processes.Gpu0Batch = None,
    bucket_cap_mb: processes.BucketCapMb = None,
    find_unused_parameters: processes.FindUnusedParameters = None,
    static_graph: processes.StaticGraph = None,
    gradient_as_bucket_view: processes.GradientAsBucketView = None,
    grad_compression: processes.GradCompression = None,
    powersgd_start_step: processes.PowersgdStartStep = None,
    # Multi-node
    nnodes: nodes.Nnodes = None,
    node_rank: nodes.NodeRank = None,
    master_addr: nodes.MasterAddr = None,
    master_port: nodes.MasterPort = None,
    rdzv_backend: nodes.RdzvBackend = None,
    rdzv_endpoint: nodes.RdzvEndpoint = None,
    rdzv_id: nodes.RdzvId = None,
    init_method: nodes.InitMethod = None,
    ifname: nodes.Ifname = None,
    timeout: nodes.Timeout = None,
    max_restarts: nodes.MaxRestarts = None,
    # Outputs and checkpoints
    out: outputs.Out = None,
    resume: outputs.Resume = None,
    overwrite: outputs.Overwrite = None,
    save_every_steps: outputs.SaveEverySteps = None,
    keep_last: outputs.KeepLast = None,
    log_dir: outputs.LogDir = None,
    log_every: outputs.LogEvery = None,
    profile_steps: outputs.ProfileSteps = None,
    tensorboard: outputs.Tensorboard = None,
    tracker: outputs.Tracker = None,
    tracking_uri: outputs.TrackingUri = None,
    experiment: outputs.Experiment = None,
    run_name: outputs.RunName = None,
    tracker_strict: outputs.TrackerStrict = None,
    tracker_checkpoints: outputs.TrackerCheckpoints = None,
    preempt_signal: outputs.PreemptSignal = None,
    # Recipe ingredients
    sync_bn: ingredients.SyncBn = None,
    ema: ingredients.Ema = None,
    ema_decay: ingredients.EmaDecay = None,
    ema_steps: ingredients.EmaSteps = None,
    mixup_alpha: ingredients.MixupAlpha = None,
    cutmix_alpha: ingredients.CutmixAlpha = None,
    auto_augment: ingredients.AutoAugment = None,
    random_erase: ingredients.RandomErase = None,
    ra_reps: ingredients.RaReps = None,
    train_crop_size: ingredients.TrainCropSize = None,
    val_resize_size: ingredients.ValResizeSize = None,
    val_crop_size: ingredients.ValCropSize = None,
    norm_weight_decay: ingredients.NormWeightDecay = None,
    # The command's own
    dry_run: command.DryRun = False,
    json_output: command.JsonOutput = False,
) -> None:
    """Train a model with DistributedDataParallel.

    One process per GPU, or Gloo processes on the CPU; on one machine or several.
    Settings come from the defaults, then a --recipe, then flags."""
    flags = given_flags(locals())
    run_command(lambda: run_training(flags, recipe, dry_run=dry_run, json_output=json_output))


def given_flags(arguments: dict[str, Any]) -> dict[str, Any]:
    """`train`'s arguments that are settings of the run, None where the flag was not given."""
    flags = {name: value for name, value in arguments.items() if name not in COMMAND_OWN}
    if not flags["model_args"]:  # Typer gives [] for a repeatable flag not given: a recipe's stands
        flags["model_args"] = None
    return flags


def run_training(
    flags: dict[str, Any], recipe: Path | None, *, dry_run: bool, json_output: bool
) -> None:
    """Flags and recipe -> one checked TrainConfig -> the launcher (or, dry, the config shown);
    then rank 0 reports, or says where the run stopped."""
    from ddpcli.config import build_train_config
    from ddpcli.environments import read_launcher_env
    from ddpcli.launcher.launch import early_fork_server

    launcher = read_launcher_env()
    cfg = checked(build_train_config(flags, recipe), launcher, flags, recipe)
    # CPU workers: their fork server imports torch beside us (ddpcli.launcher.fork).
    with contextlib.nullcontext() if dry_run else early_fork_server(cfg, launcher):
        launched = resolve_and_launch(cfg, launcher, dry_run=dry_run, json_output=json_output)
    if launched is None:
        return
    cfg, summary = launched
    if summary.get("stopped"):
        stopped = stopped_early(summary)
        if launcher is not None and launcher.rank != 0:  # torchrun's ranks: rank 0 says it
            raise SystemExit(stopped.exit_code)
        raise stopped
    report_training(cfg, summary, json_output)


def checked(
    cfg: TrainConfig, launcher: LauncherEnv | None, flags: dict[str, Any], recipe: Path | None
) -> TrainConfig:
    """The run checked against the flags and the disk, before torch is imported: a typo
    costs nothing. An error names where each setting it names came from."""
    from ddpcli.config.train import train_setting_origins, with_origins
    from ddpcli.launcher.resolve import checked_train_config

    try:
        return checked_train_config(cfg, launcher)
    except DdpcliError as error:
        raise with_origins(error, train_setting_origins(flags, recipe)) from None


def resolve_and_launch(
    cfg: TrainConfig, launcher: LauncherEnv | None, *, dry_run: bool, json_output: bool
) -> tuple[TrainConfig, dict[str, Any]] | None:
    """Resolve what needs torch, check the rest, then launch: the run's config and rank
    0's summary (None for a dry run, shown)."""
    from ddpcli.launcher.resolve import with_cpu_precision, with_usable_gpus
    from ddpcli.training.preflight import preflight

    cfg = with_cpu_precision(with_usable_gpus(cfg))

    built = preflight(cfg)  # the user's own code runs here first: exit 2 before workers
    from ddpcli.checkpoint.schema import check_resume_source, with_checked_resume

    if dry_run:
        check_resume_source(cfg)  # a bad --resume file: exit 2, as the run would say it
        show_config(cfg, json_output, built)
        return None
    from ddpcli.launcher.launch import launch_train
    from ddpcli.outputs.runfolder import continue_after_requeue

    cfg = continue_after_requeue(cfg, launcher)
    cfg = with_checked_resume(cfg)  # a bad --resume file: exit 2 now, before any worker starts
    try:
        return cfg, launch_train(cfg, debug=_state["debug"])
    except KeyboardInterrupt as stop:  # under torchrun this process was the rank itself
        record = getattr(stop, "record", None)  # ddpcli.training.stopping.Interrupted's
        if record is None:
            raise
        return cfg, record


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
    """The last epoch's data wait and compute per rank; the straggler named, with a hint;
    each rank's step split into data wait, compute, exposed communication and optimizer."""
    from ddpcli.outputs.rankload import breakdown_lines, straggler_note

    if summary.get("step_breakdown"):
        ui.info("where the step time went, last epoch (host clocks):")
        for line in breakdown_lines(summary["step_breakdown"]):
            ui.info(f"  {line}")
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
