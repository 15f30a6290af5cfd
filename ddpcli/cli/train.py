"""`ddpcli train`: flags and a recipe -> one validated TrainConfig -> the launcher."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ddpcli import ui
from ddpcli.cli import _state, app, run_command

# --- train ----------------------------------------------------------------------------------

DATA = "Data"
MODEL = "Model and optimisation"
PROCS = "Processes and devices"
NODES = "Multi-node"
OUTPUT = "Outputs and checkpoints"


@app.command(no_args_is_help=False)
def train(
    recipe: Annotated[Path | None, typer.Option(help="TOML recipe; flags override it.")] = None,
    dataset: Annotated[
        str | None, typer.Option(help="synthetic | stl10 | imagefolder.", rich_help_panel=DATA)
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option(help="Data folder.", rich_help_panel=DATA)
    ] = None,
    download: Annotated[
        bool | None,
        typer.Option(
            "--download/--no-download", help="Fetch STL-10 on rank 0 first.", rich_help_panel=DATA
        ),
    ] = None,  # fmt: skip
    image_size: Annotated[
        int | None, typer.Option(help="Side in px.", rich_help_panel=DATA)
    ] = None,
    synthetic_size: Annotated[
        int | None, typer.Option(help="Training images of the synthetic set.", rich_help_panel=DATA)
    ] = None,
    data_path: Annotated[
        str | None,
        typer.Option(
            help="auto | device (uint8 set in device memory, augmented there) | loader "
            "(DataLoader workers). auto: device for synthetic/stl10 when the set takes at most "
            "a quarter of free device memory.",
            rich_help_panel=DATA,
        ),
    ] = None,  # fmt: skip
    workers: Annotated[
        int | None, typer.Option(help="DataLoader workers per rank.", rich_help_panel=DATA)
    ] = None,
    arch: Annotated[
        str | None,
        typer.Option(help="torchvision model name or smallcnn/tinycnn.", rich_help_panel=MODEL),
    ] = None,
    epochs: Annotated[int | None, typer.Option(rich_help_panel=MODEL)] = None,
    per_gpu_batch: Annotated[
        int | None, typer.Option(help="Batch of one process.", rich_help_panel=MODEL)
    ] = None,
    accumulate: Annotated[
        int | None, typer.Option(help="Micro-batches per optimizer step.", rich_help_panel=MODEL)
    ] = None,
    lr: Annotated[
        float | None, typer.Option(help="Peak learning rate.", rich_help_panel=MODEL)
    ] = None,
    momentum: Annotated[float | None, typer.Option(rich_help_panel=MODEL)] = None,
    weight_decay: Annotated[float | None, typer.Option(rich_help_panel=MODEL)] = None,
    warmup_epochs: Annotated[float | None, typer.Option(rich_help_panel=MODEL)] = None,
    label_smoothing: Annotated[float | None, typer.Option(rich_help_panel=MODEL)] = None,
    seed: Annotated[int | None, typer.Option(rich_help_panel=MODEL)] = None,
    precision: Annotated[
        str | None, typer.Option(help="auto | bf16 | fp16 | fp32.", rich_help_panel=MODEL)
    ] = None,
    compile: Annotated[
        bool | None,
        typer.Option("--compile", help="torch.compile the model.", rich_help_panel=MODEL),
    ] = None,
    max_steps: Annotated[
        int | None, typer.Option(help="Stop after N optimizer steps.", rich_help_panel=MODEL)
    ] = None,
    gpus: Annotated[
        str | None,
        typer.Option(help="Physical GPU indices, one process each: 0,3.", rich_help_panel=PROCS),
    ] = None,
    cpu: Annotated[
        bool | None, typer.Option("--cpu", help="Gloo processes on the CPU.", rich_help_panel=PROCS)
    ] = None,
    nproc: Annotated[
        int | None,
        typer.Option(help="Processes per node on the CPU (default 2).", rich_help_panel=PROCS),
    ] = None,  # fmt: skip
    backend: Annotated[
        str | None, typer.Option(help="auto | nccl | gloo.", rich_help_panel=PROCS)
    ] = None,
    strategy: Annotated[
        str | None, typer.Option(help="ddp | dp | balanced-dp.", rich_help_panel=PROCS)
    ] = None,
    gpu0_batch: Annotated[
        int | None,
        typer.Option(
            help="balanced-dp: GPU 0's share of each --per-gpu-batch batch (2 of 8 on three "
            "GPUs: 2+3+3).",
            rich_help_panel=PROCS,
        ),
    ] = None,
    bucket_cap_mb: Annotated[
        float | None,
        typer.Option(help="DDP gradient bucket size in MB (default 25).", rich_help_panel=PROCS),
    ] = None,
    nnodes: Annotated[int | None, typer.Option(rich_help_panel=NODES)] = None,
    node_rank: Annotated[int | None, typer.Option(rich_help_panel=NODES)] = None,
    master_addr: Annotated[str | None, typer.Option(rich_help_panel=NODES)] = None,
    master_port: Annotated[int | None, typer.Option(rich_help_panel=NODES)] = None,
    init_method: Annotated[
        str | None,
        typer.Option(help="env:// | tcp://HOST:PORT | file:///PATH.", rich_help_panel=NODES),
    ] = None,
    ifname: Annotated[
        str | None, typer.Option(help="Network interface for Gloo/NCCL.", rich_help_panel=NODES)
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(help="Seconds for init and each collective.", rich_help_panel=NODES),
    ] = None,
    max_restarts: Annotated[int | None, typer.Option(rich_help_panel=NODES)] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Output folder (default runs/<time>).", rich_help_panel=OUTPUT),
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(help="PATH or auto (OUT/checkpoints/last.pt).", rich_help_panel=OUTPUT),
    ] = None,
    save_every_steps: Annotated[int | None, typer.Option(rich_help_panel=OUTPUT)] = None,
    keep_last: Annotated[
        int | None, typer.Option(help="Epoch/step checkpoints to keep.", rich_help_panel=OUTPUT)
    ] = None,
    log_dir: Annotated[
        Path | None, typer.Option(help="One log file per rank.", rich_help_panel=OUTPUT)
    ] = None,
    log_every: Annotated[int | None, typer.Option(rich_help_panel=OUTPUT)] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the resolved config and exit.")
    ] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Train a model with DistributedDataParallel: one process per GPU, or Gloo on the CPU."""
    flags = {
        key: value
        for key, value in locals().items()
        if key not in ("recipe", "dry_run", "json_output")
    }

    def action() -> None:
        from ddpcli.config import build_train_config
        from ddpcli.environments import read_launcher_env
        from ddpcli.resolve import resolve_train_config

        cfg = resolve_train_config(build_train_config(flags, recipe), read_launcher_env())
        if dry_run:
            show_config(cfg, json_output)
            return
        from ddpcli.checkpoint.schema import check_resume_source
        from ddpcli.launch import launch_train

        check_resume_source(cfg)  # a bad --resume file: exit 2 now, before any worker starts
        summary = launch_train(cfg, debug=_state["debug"])
        report_training(cfg, summary, json_output)

    run_command(action)


def show_config(cfg, json_output: bool) -> None:
    document = cfg.model_dump(mode="json")
    document.update(world_size=cfg.world_size, global_batch=cfg.global_batch)
    if json_output:
        ui.print_json(document)
        return
    for key, value in document.items():
        typer.echo(f"{key} = {value}")


def resource_line(cfg, summary: dict) -> str:
    """What the run cost: images/s for the strategy that ran, and peak memory per device."""
    line = f"strategy {cfg.strategy}: {summary.get('images_per_sec', 0):.0f} img/s"
    if summary.get("peak_memory_mb"):
        label = "per GPU" if cfg.strategy != "ddp" else "per GPU (by rank)"
        peaks = ", ".join(f"{i}: {mb:.0f}" for i, mb in enumerate(summary["peak_memory_mb"]))
        return f"{line} · peak GPU memory allocated {label}, MB: {peaks}"
    if summary.get("peak_rss_mb"):
        peaks = ", ".join(f"{i}: {mb:.0f}" for i, mb in enumerate(summary["peak_rss_mb"]))
        return f"{line} · no GPU; peak host memory (RSS) per rank, MB: {peaks}"
    return line


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
    ui.info(
        f"outputs in {summary.get('out')}: metrics.jsonl, config.json, checkpoints/last.pt, best.pt"
    )
    if cfg.cpu:
        ui.info(
            "to scale up: `ddpcli train --gpus 0,1 --recipe recipes/stl10-resnet18.toml` on a GPU "
            "machine, or add --nnodes/--node-rank/--master-addr to span machines (docs/train.md)"
        )
