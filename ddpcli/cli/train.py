"""`ddpcli train`: flags and a recipe -> the request (one validated TrainConfig) -> the run's
plan (ddpcli.launcher.plan) -> the launcher.

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
from ddpcli.config.plan import RunPlan
from ddpcli.errors import INTERRUPTED, RUNTIME, DdpcliError
from ddpcli.outputs.summary import RunSummary

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
    decode: data.Decode = None,
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
    global_batch: model.GlobalBatch = None,
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
    compile_mode: model.CompileMode = None,
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
    flight_recorder: processes.FlightRecorder = None,
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
    """Flags and recipe -> the request (one validated TrainConfig) -> the run's plan -> the
    launcher (or, dry, the plan shown); then rank 0 reports, or says where the run stopped."""
    from ddpcli.config.train import settle_train_request
    from ddpcli.environments import read_launcher_env

    settled = settle_train_request(flags, recipe)
    request = settled.config
    launcher = read_launcher_env()
    if launcher is None or launcher.rank == 0:  # torchrun's ranks: rank 0 says it
        for line in settled.left_out:
            ui.info(line)
    from ddpcli.launcher.plan import plan_run  # after the request: a typo costs no import

    with contextlib.ExitStack() as workers:

        def start_fork_server(plan: RunPlan) -> None:
            # CPU workers: their fork server shares our torch import (ddpcli.launcher.fork).
            from ddpcli.launcher.engine import early_fork_server
            from ddpcli.launcher.train_launch import WORKER_MODULE

            workers.enter_context(early_fork_server(WORKER_MODULE, plan.uses_gpus, launcher))

        plan = plan_run(
            request,
            launcher,
            origins=settled.origins,
            on_checked=None if dry_run else start_fork_server,
        )
        if dry_run:
            show_config(plan, json_output)
            return
        summary = launched_said_as_json(plan) if json_output else launched(plan)
    if summary.stop is not None:
        stopped = stopped_early(summary)
        if launcher is not None and launcher.rank != 0:  # torchrun's ranks: rank 0 says it
            raise SystemExit(stopped.exit_code)
        raise stopped
    report_training(plan, summary, json_output)


def launched_said_as_json(plan: RunPlan) -> RunSummary:
    """launched(PLAN), and a failure that carries data (the collective verdict) said on
    stdout as one JSON document too, as a finished run's summary would be."""
    try:
        return launched(plan)
    except DdpcliError as failed:
        if failed.data:
            ui.print_json(failed.document())
        raise


def launched(plan: RunPlan) -> RunSummary:
    """Rank 0's summary of the run PLAN describes."""
    from ddpcli.launcher.train_launch import launch_train

    try:
        return launch_train(plan, debug=_state["debug"])
    except KeyboardInterrupt as stop:  # under torchrun this process was the rank itself
        record = getattr(stop, "record", None)  # ddpcli.training.stopping.Interrupted's
        if record is None:
            raise
        return RunSummary(stop=record)


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


def stopped_early(summary: RunSummary) -> DdpcliError:
    """Ctrl-C: exit 130; a preemption or a termination: exit 1. One line: where, what was
    saved, what next."""
    stop = summary.stop
    assert stop is not None  # the run stopped early
    where = f"epoch {stop.stopped_epoch} step {stop.stopped_step}"
    resume = resume_command(stop.out)
    saved = summary.last_checkpoint
    if saved and stop.checkpoint_at:
        saved = f"{saved} ({stop.checkpoint_at})"
    checkpoint = f"last checkpoint: {saved}" if saved else "no checkpoint saved yet"
    if stop.stopped == "interrupted":
        return DdpcliError(f"interrupted at {where}; {checkpoint}; resume: {resume}", INTERRUPTED)
    if stop.stopped == "terminated":  # SIGTERM, with --preempt-signal USR1
        preempt = (stop.preempt_signal or "").removeprefix("SIG")
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


def show_config(plan: RunPlan, json_output: bool) -> None:
    """The dry run's answer: the plan, its world and global batch, and what the model check
    found (model_facts, which config.json never holds)."""
    document = plan.model_dump(mode="json")
    document.update(
        world_size=plan.world_size, global_batch=plan.planned_global_batch, **plan.model_facts
    )
    if json_output:
        ui.print_json(document)
        return
    for key, value in document.items():
        typer.echo(f"{key} = {value}")


def resource_line(cfg, epoch: dict[str, Any]) -> str:
    """What the run cost: images/s for the strategy that ran, and peak memory per device.
    EPOCH: the last epoch's row of metrics.jsonl."""
    line = f"strategy {cfg.strategy}: {ui.rate_of(epoch)}"
    if epoch.get("peak_memory_mb"):
        label = "per GPU" if cfg.strategy != "ddp" else "per GPU (by rank)"
        peaks = ", ".join(f"{i}: {mb:.0f}" for i, mb in enumerate(epoch["peak_memory_mb"]))
        return f"{line} · peak GPU memory allocated {label}, MB: {peaks}"
    if epoch.get("peak_rss_mb"):
        peaks = ", ".join(f"{i}: {mb:.0f}" for i, mb in enumerate(epoch["peak_rss_mb"]))
        return f"{line} · no GPU; peak host memory (RSS) per rank, MB: {peaks}"
    return line


def report_rank_load(cfg, summary: RunSummary) -> None:
    """The last epoch's data wait and compute per rank; the straggler named, with a hint;
    each rank's step split into data wait, compute, exposed communication and optimizer."""
    from ddpcli.outputs.rankload import breakdown_lines, straggler_note

    if summary.step_breakdown:
        ui.info("where the step time went, last epoch (host clocks):")
        for line in breakdown_lines(summary.step_breakdown):
            ui.info(f"  {line}")
    epoch = summary.last_epoch
    if "data_wait_frac_per_rank" not in epoch:
        return
    waits = ", ".join(
        f"{i}: {100 * f:.0f}%" for i, f in enumerate(epoch["data_wait_frac_per_rank"])
    )
    computes = ", ".join(f"{i}: {ms:.1f}" for i, ms in enumerate(epoch["compute_ms_per_rank"]))
    ui.info(
        f"data wait {100 * epoch['data_wait_frac']:.0f}% of the step (per rank: {waits}) · "
        f"compute per step, ms: {computes}"
    )
    if note := straggler_note(epoch):
        ui.warn(note)


def report_training(cfg, summary: RunSummary, json_output: bool) -> None:
    from ddpcli.environments import read_launcher_env

    launcher = read_launcher_env()
    if launcher is not None and launcher.rank != 0:
        return
    if json_output:
        ui.print_json(summary.to_dict())
        return
    if summary.node_rank != 0:
        ui.info(f"node {summary.node_rank} finished; node 0 (rank 0) writes the outputs")
        return
    if "val_acc" in summary.last_epoch:
        ui.info(f"done: {ui.format_metrics(summary.last_epoch)}")
        ui.info(resource_line(cfg, summary.last_epoch))
        report_rank_load(cfg, summary)
    if summary.skipped is not None and summary.skipped.count:
        ui.warn(
            f"--skip-bad-images left out {summary.skipped.count} image(s) that cannot be "
            f"decoded: listed in {summary.skipped.listed_in}"
        )
    ui.info(
        f"outputs in {summary.out}: metrics.jsonl, steps.jsonl, config.json, "
        "checkpoints/last.pt, best.pt"
    )
    if summary.curves:
        ui.info(f"curves: {summary.curves} (compare runs: ddpcli plot RUN_DIR RUN_DIR ...)")
    if cfg.cpu:
        ui.info(
            "to scale up: `ddpcli train --gpus 0,1 --recipe recipes/stl10-resnet18.toml` on a GPU "
            "machine, or add --nnodes/--node-rank/--master-addr to span machines (docs/train.md)"
        )
