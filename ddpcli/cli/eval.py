"""`ddpcli eval CHECKPOINT`: flags -> one validated EvalConfig -> the evaluation engine
(ddpcli.evaluation) -> a table on stderr, or one JSON document on stdout with --json.

The launch flags are `train`'s own options (ddpcli.cli.train_options: processes, nodes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ddpcli import ui
from ddpcli.cli.app import _state, app, run_command
from ddpcli.cli.options import setting
from ddpcli.cli.train_options import nodes, processes
from ddpcli.config.eval import EvalConfig

DATA = "Data"
MODEL = "Model and view (the checkpoint's unless given)"
OUTPUTS = "Outputs"
PER_CLASS_ROWS = 20  # more classes: the weakest by F1, then the file has them all


def eval_option(name: str, help: str | None = None, panel: str = DATA, default: str | None = None):
    return setting(EvalConfig, name, help, panel=panel, default=default)


Checkpoint = Annotated[
    Path, typer.Argument(help="A checkpoint: best.pt, last.pt, a state dict or a .safetensors.")
]
DataDir = Annotated[
    str | None,  # a URL of shards too: Typer's Path would turn s3://b into s3:/b
    eval_option(
        "data_dir",
        "Image folder (DIR/SPLIT/<class>/*, or DIR/<class>/*), or packed shards (a folder "
        "or URL holding index.json).",
        default="the run's",
    ),
]
Dataset = Annotated[
    str | None,
    eval_option(
        "dataset",
        "synthetic | stl10 | imagefolder | shards | pkg.module:factory.",
        default="the run's; shards or imagefolder with --data-dir",
    ),
]
Split = Annotated[str | None, eval_option("split", "Which split to measure.")]
Weights = Annotated[
    str | None,
    eval_option("weights", "Which weights.", MODEL, default="ema when the checkpoint has it"),
]
Arch = Annotated[
    str | None,
    eval_option(
        "arch",
        "The model to build; needed for a plain state dict, and to run an import path the "
        "file names.",
        MODEL,
        default="the checkpoint's",
    ),
]
Trust = Annotated[
    bool | None,
    eval_option(
        "trust_checkpoint_code",
        "Build the file's import-path arch or data set without naming it.",
        MODEL,
    ),
]
ImageSize = Annotated[
    int | None, eval_option("image_size", "Image side.", MODEL, default="the run's")
]
ValResize = Annotated[
    int | None,
    eval_option(
        "val_resize_size", "Shorter side before the centre crop.", MODEL, default="the run's"
    ),
]
ValCrop = Annotated[
    int | None,
    eval_option(
        "val_crop_size", "Centre crop: evaluate at another resolution.", MODEL, default="the run's"
    ),
]
Precision = Annotated[
    str | None,
    eval_option(
        "precision",
        "Autocast dtype; the run's reproduces its own figure.",
        MODEL,
        default="the run's",
    ),  # fmt: skip
]
PerGpuBatch = Annotated[
    int | None, eval_option("per_gpu_batch", "Images per batch.", MODEL, default="the run's")
]
Workers = Annotated[int | None, eval_option("workers", default="as train")]
Out = Annotated[
    Path | None,
    eval_option("out", "The eval folder.", OUTPUTS, default="CHECKPOINT's folder/eval-STEM-SPLIT"),
]
Predictions = Annotated[bool | None, eval_option("predictions", panel=OUTPUTS)]
FlightRecorder = Annotated[bool | None, eval_option("flight_recorder", panel=OUTPUTS)]
JsonOutput = Annotated[
    bool,
    typer.Option("--json", help="Print one JSON document on stdout.", rich_help_panel=OUTPUTS),
]
COMMAND_OWN = ("json_output",)


@app.command("eval")
def evaluate(
    checkpoint: Checkpoint,
    data_dir: DataDir = None,
    dataset: Dataset = None,
    split: Split = None,
    weights: Weights = None,
    arch: Arch = None,
    trust_checkpoint_code: Trust = None,
    image_size: ImageSize = None,
    val_resize_size: ValResize = None,
    val_crop_size: ValCrop = None,
    precision: Precision = None,
    per_gpu_batch: PerGpuBatch = None,
    workers: Workers = None,
    out: Out = None,
    predictions: Predictions = None,
    flight_recorder: FlightRecorder = None,
    json_output: JsonOutput = False,
    # Processes and devices, Multi-node: as `train` takes them
    gpus: processes.Gpus = None,
    cpu: processes.Cpu = None,
    nproc: processes.Nproc = None,
    backend: processes.Backend = None,
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
) -> None:
    """Measure a checkpoint on held-out images, per class too.

    Top-1, top-5, loss, and each class's precision, recall and F1. The model and its
    preprocessing are rebuilt from the checkpoint. Every image is counted once at any world
    size, so 1, 2 or 3 processes give the same figures. Writes metrics.json, per_class.csv,
    confusion.csv and confusion.png (--out)."""
    flags = {name: value for name, value in locals().items() if name not in COMMAND_OWN}
    run_command(lambda: run_evaluation(flags, json_output))


def run_evaluation(flags: dict[str, Any], json_output: bool) -> None:
    from ddpcli.config.eval import build_eval_config
    from ddpcli.environments import read_launcher_env
    from ddpcli.evaluation.run import run_eval

    cfg = build_eval_config(flags)
    report = run_eval(cfg, debug=_state["debug"])
    launcher = read_launcher_env()
    if report is None or "top1" not in report or (launcher is not None and launcher.rank != 0):
        return
    if json_output:
        ui.print_json(report)
    else:
        show_report(report)


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def show_report(report: dict[str, Any]) -> None:
    from rich.table import Table

    ui.info(
        f"{report['checkpoint']}: {report['arch']}, {report['weights']} weights "
        f"({report['weights_reason']}), {report['precision']} ({report['precision_reason']})"
    )
    table = Table(title=f"eval on {report['data']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row(
        "top-1", f"{percent(report['top1'])} ({report['correct']} of {report['samples']})"
    )
    if report.get("top5") is not None:
        table.add_row("top-5", percent(report["top5"]))
    table.add_row("loss", f"{report['loss']:.4f}")
    table.add_row("macro F1", percent(report.get("macro_f1")))
    sizes = (report["image_size"], report["val_resize_size"], report["val_crop_size"])
    table.add_row("view", "{} px, resize {}, crop {}".format(*sizes))
    table.add_row("speed", speed_words(report))
    ui.console.print(table)
    ui.console.print(per_class_table(report["per_class"]))
    if line := run_comparison(report):
        ui.info(line)
    ui.info(f"eval folder: {report['out']} (metrics.json, per_class.csv, confusion.csv/png"
            + (", predictions.csv)" if "predictions" in report["files"] else ")"))  # fmt: skip


def speed_words(report: dict[str, Any]) -> str:
    rate = report.get("images_per_sec")
    shown = f"{rate:.0f} img/s" if rate else "not measured"
    return f"{shown} · {report['world_size']} process(es) on {report['device']}"


def per_class_table(rows: list[dict[str, Any]]):
    from rich.table import Table

    from ddpcli.data.layout import shown_name

    present = [row for row in rows if row["support"]]
    shown = present
    title = "per class"
    if len(present) > PER_CLASS_ROWS:
        shown = sorted(present, key=lambda row: (row["f1"] or 0.0, row["class"]))[:PER_CLASS_ROWS]
        title = f"per class: the {PER_CLASS_ROWS} weakest by F1 of {len(present)} (per_class.csv)"
    table = Table(title=title, title_justify="left")
    for column in ("class", "precision", "recall", "F1", "support"):
        table.add_column(column, justify="left" if column == "class" else "right")
    for row in shown:
        table.add_row(
            shown_name(str(row["class"])), percent(row["precision"]), percent(row["recall"]),
            percent(row["f1"]), str(row["support"]),
        )  # fmt: skip
    return table


def run_comparison(report: dict[str, Any]) -> str:
    """`the run's own val acc at epoch 3: 81.25% (same weights, same view)`."""
    run = report.get("run") or {}
    if run.get("val_acc") is None:
        return ""
    same = run["val_acc"] == report["top1"]
    why = "the same" if same else "another figure: other weights, view, precision or data"
    return (
        f"the run's own {report['weights']} val acc at epoch {run.get('epoch')}: "
        f"{percent(run['val_acc'])} ({why})"
    )
