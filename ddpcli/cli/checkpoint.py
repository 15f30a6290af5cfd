"""`ddpcli checkpoint inspect|verify|convert`: read checkpoints safely, never run them.

The engine (ddpcli.checkpoint) returns plain data; this module only shows it: a rich
table on stderr for people, one JSON document on stdout with `--json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ddpcli import ui
from ddpcli.cli.app import checkpoint_app, run_command
from ddpcli.cli.options import option
from ddpcli.errors import runtime_error, usage_error

if TYPE_CHECKING:
    from ddpcli.config.convert import ConvertConfig

CheckpointPath = Annotated[Path, typer.Argument(help="A checkpoint file (.pt).")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]


@checkpoint_app.command("inspect")
def inspect(path: CheckpointPath, json_output: JsonFlag = False) -> None:
    """Show a checkpoint's progress, metrics, config and tensors.

    Epoch, step, metrics, the settings not at their defaults (--json: all of them), tensor
    and parameter counts, dtypes and devices, and whether keys carry DDP's `module.` prefix.

    Loads with weights_only=True: a file that needs arbitrary Python objects is refused."""

    def action() -> None:
        from ddpcli.checkpoint.report import inspect_checkpoint

        report = inspect_checkpoint(path)
        if json_output:
            ui.print_json(report)
        else:
            show_inspection(report)

    run_command(action)


@checkpoint_app.command("verify")
def verify(
    path: CheckpointPath,
    arch: Annotated[
        str | None,
        option("Model to check a plain state dict against.", default="the file's, if named"),
    ] = None,
    num_classes: Annotated[
        int | None,
        option("Classes of that model.", default="the file's, else its head's size"),
    ] = None,
    trust_checkpoint_code: Annotated[
        bool,
        typer.Option(
            "--trust-checkpoint-code",
            help="Import the model code the file's config names (pkg.module:factory); "
            "without it only built-in, torchvision and timm names are rebuilt.",
        ),
    ] = False,
    json_output: JsonFlag = False,
) -> None:
    """Check a checkpoint's digest, tensors and fit to its model.

    The recorded SHA-256, finite tensors, and that the model accepts the weights.

    Loads with weights_only=True, and runs no code the file names: a model given there as
    an import path is checked only with the same --arch or --trust-checkpoint-code. Exit 1
    with the reason if a check fails, 2 if the file cannot be read safely at all."""

    def action() -> None:
        check_verify_options(arch, num_classes)
        from ddpcli.checkpoint.report import verify_checkpoint

        report = verify_checkpoint(
            path, arch=arch, num_classes=num_classes, trust_code=trust_checkpoint_code
        )
        if json_output:
            ui.print_json(report)
        else:
            show_checks(report)
        failed = [check for check in report["checks"] if check["status"] == "fail"]
        if failed:
            reasons = "; ".join(f"{check['check']}: {check['detail']}" for check in failed)
            raise runtime_error(f"{path} failed verification: {reasons}")
        if not json_output:
            ui.info(f"{path}: OK")

    run_command(action)


def check_verify_options(arch: str | None, num_classes: int | None) -> None:
    """A model the check cannot build is bad input, not a verdict on the file: exit 2."""
    from ddpcli.models.archs import check_arch

    if arch is not None:
        check_arch(arch)
    if num_classes is not None and num_classes < 1:
        raise usage_error(f"invalid --num-classes: a model has 1 class or more (got {num_classes})")


@checkpoint_app.command("convert")
def convert(
    path: Annotated[
        Path, typer.Argument(help="A checkpoint (.pt), a state dict or a .safetensors file.")
    ],
    out: Annotated[Path, typer.Argument(help="File to write.")],
    to: Annotated[
        str | None,
        option(
            "Format: pt (a plain state dict), safetensors (weights and metadata), onnx or "
            "pt2 (torch.export), the last two checked against eager PyTorch.",
            default="from OUT's suffix, else pt",
            metavar="pt|safetensors|onnx|pt2",
        ),
    ] = None,
    strip_ddp_prefix: Annotated[
        bool, typer.Option("--strip-ddp-prefix", help="Drop the `module.` that DDP adds to keys.")
    ] = False,
    weights_only: Annotated[
        bool,
        typer.Option(
            "--weights-only",
            help="Keep epoch, metrics and config with the weights; drop optimizer and RNG state.",
        ),
    ] = False,
    weights: Annotated[
        str | None,
        option(
            "The EMA's averaged weights or the trained ones.",
            default="ema when saved",
            metavar="ema|raw",
        ),
    ] = None,
    arch: Annotated[
        str | None, option("Model to rebuild for onnx and pt2.", default="the file's, if named")
    ] = None,
    trust_checkpoint_code: Annotated[
        bool,
        typer.Option(
            "--trust-checkpoint-code",
            help="Import the model code the file names (pkg.module:factory) to export it.",
        ),
    ] = False,
    image_size: Annotated[
        int | None,
        option("Side of the exported input (onnx, pt2).", default="the run's validation crop"),
    ] = None,
    tolerance: Annotated[
        float | None,
        option(
            "Largest absolute difference of the logits allowed against eager PyTorch, "
            "times the largest logit where that is above 1.",
            default="1e-4",
        ),
    ] = None,
    check_batch: Annotated[
        int | None, option("The larger batch the export is checked on.", default="4")
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Replace OUT if it exists (without it, an existing OUT is kept: exit 2).",
        ),
    ] = False,
    json_output: JsonFlag = False,
) -> None:
    """Write the weights as pt, safetensors, ONNX or pt2 files.

    pt is what `torchvision.models.ARCH(num_classes=N).load_state_dict` takes; --weights-only
    keeps epoch, metrics and config but drops optimizer and RNG state. safetensors keeps
    arch, classes and preprocessing in its header. onnx (dynamic batch) and pt2 are checked
    against eager PyTorch on a batch of 1 and of 4: exit 1 past the tolerance. safetensors
    and onnx need `pip install 'ddpcli\\[export]'`."""

    flags = {
        "path": path, "out": out, "to": to, "strip_ddp_prefix": strip_ddp_prefix,
        "weights_only": weights_only, "weights": weights, "arch": arch,
        "trust_checkpoint_code": trust_checkpoint_code, "image_size": image_size,
        "tolerance": tolerance, "check_batch": check_batch, "overwrite": overwrite,
    }  # fmt: skip

    def action() -> None:
        from ddpcli.config.convert import build_convert_config

        report = convert_to(build_convert_config(flags))
        if json_output:
            ui.print_json(report)
        else:
            show_conversion(report)

    run_command(action)


def convert_to(cfg: ConvertConfig) -> dict[str, Any]:
    """--to pt from a .pt file copies its tensors (`convert_checkpoint`); every other case,
    a .safetensors source included, goes through `export_checkpoint`."""
    from ddpcli.checkpoint.safetensors_io import is_safetensors_file

    if cfg.to == "pt" and not is_safetensors_file(cfg.path):
        from ddpcli.checkpoint.report import convert_checkpoint

        return convert_checkpoint(
            cfg.path, cfg.out, cfg.strip_ddp_prefix, cfg.weights_only, cfg.weights, cfg.overwrite
        )
    from ddpcli.checkpoint.export import export_checkpoint

    return export_checkpoint(cfg)


def show_conversion(report: dict[str, Any]) -> None:
    weights = {"ema": " (the EMA's averaged weights; --weights raw for the trained ones)",
               "raw": ""}.get(report.get("weights") or "", "")  # fmt: skip
    if "checks" in report:
        ui.info(f"checked against eager PyTorch: {check_words(report)}")
    layout = report.get("layout") or report["to"]
    ui.info(
        f"wrote {report['out']}: {layout} of {report['tensors']} tensors "
        f"({report['parameters']:,} parameters), {ui.byte_size(report['size_bytes'])}{weights}"
    )
    if report.get("ddp_prefix"):
        ui.warn("keys still start with `module.`; add --strip-ddp-prefix for a plain model")
    if report.get("load_hint"):
        # Soft-wrapped so the line stays one line when copied from the terminal.
        ui.console.print(f"load it with: {report['load_hint']}", markup=False, soft_wrap=True)


def check_words(report: dict[str, Any]) -> str:
    batches = ", ".join(
        f"batch {check['batch']} max abs diff {check['max_abs_diff']:.2g}"
        for check in report["checks"]
    )
    shape = ", ".join(map(str, report["input_shape"]))
    return f"{batches} (tolerance {report['tolerance']:.2g}); input ({shape})"


# --- Showing reports ----------------------------------------------------------------------


KIND_WORDS = {
    "training": "ddpcli training checkpoint",
    "weights-only": "ddpcli weights-only checkpoint (cannot resume)",
    "state-dict": "plain state dict",
    "safetensors": "safetensors file (weights and a header: cannot resume)",
    "unknown": "not a checkpoint ddpcli recognises",
}


def show_inspection(report: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"checkpoint {report['path']}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for name, value in inspection_rows(report):
        table.add_row(name, value)
    ui.console.print(table)
    if report.get("metrics"):
        ui.console.print(metrics_table(report["metrics"]))
    if report.get("config"):
        settings = (f"{k}={v}" for k, v in not_at_defaults(report["config"]).items())
        ui.info("config, beside the defaults (--json: all): " + " ".join(settings))


def not_at_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """The settings of a saved CONFIG that differ from today's defaults as a config resolves
    them, and what the run found (peak_lr, the reasons for its auto choices): among all ~100
    settings they were hard to find."""
    from ddpcli.config.train import TrainConfig

    defaults = json.loads(TrainConfig.model_validate({}).model_dump_json())  # as saved
    return {
        name: value
        for name, value in config.items()
        if value is not None and value is not False
        and (name not in defaults or value != defaults[name])
    }  # fmt: skip


def inspection_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    kind = KIND_WORDS[report["kind"]]
    if report["kind"] == "training" and not report.get("resumable"):
        kind += " (incomplete: cannot resume)"
    rows = [("kind", kind)]
    if "step" in report:
        rows.append(("progress", progress_words(report)))
        rows.append(("world size", str(report["world_size"])))
        rows.append(("architecture", f"{report['arch']} · {report['num_classes']} classes"))
        if report.get("classes"):
            rows.append(("classes", listed_names(report["classes"])))
        if report.get("best_val_acc") is not None and report["best_val_acc"] >= 0:
            rows.append(("best val acc", f"{100 * report['best_val_acc']:.2f}%"))
    if report["kind"] == "safetensors" and report.get("arch"):
        rows.append(("architecture", f"{report['arch']} · {report['num_classes']} classes"))
        if report.get("classes"):
            rows.append(("classes", listed_names(report["classes"])))
    model = report.get("model")
    if model:
        rows.append(("parameters", f"{model['parameters']:,} in {model['tensors']} tensors"))
        rows.append(("model size", ui.byte_size(model["bytes"])))
        dtypes = ", ".join(f"{name} ×{count}" for name, count in model["dtypes"].items())
        rows.append(("dtypes", dtypes))
        prefix = "yes: keys start with `module.`" if model["ddp_prefix"] else "no"
        rows.append(("DDP `module.` prefix", prefix))
    devices = ", ".join(f"{name} ×{count}" for name, count in report["devices"].items())
    rows.append(("saved on", devices or "-"))
    rows.append(("tensors in file", str(report["tensors"])))
    rows.append(("size on disk", ui.byte_size(report["size_bytes"])))
    rows.append(("sha256", digest_words(report["digest"])))
    return rows


def listed_names(names: list[str], shown: int = 10) -> str:
    """`cat, dog, owl`; past SHOWN names, the first ones and how many more."""
    more = f" … and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(map(str, names[:shown])) + more


def progress_words(report: dict[str, Any]) -> str:
    done, planned = report["epochs_done"], report.get("epochs_planned") or "?"
    if report.get("batch_in_epoch"):
        where = f"inside epoch {done + 1} of {planned}, after batch {report['batch_in_epoch']}"
    else:
        where = f"{done} of {planned} epochs done"
    return f"{where} · step {report['step']}"


def digest_words(digest: dict[str, Any]) -> str:
    if digest["status"] == "missing":
        return "not recorded (no .sha256 beside the file)"
    if digest["status"] == "unreadable":
        return "unreadable (the .sha256 beside the file holds no digest)"
    if digest["status"] == "mismatch":
        return f"MISMATCH: file {digest['sha256'][:16]}…, recorded {digest['recorded'][:16]}…"
    return f"ok {digest['sha256'][:16]}…"


def metrics_table(metrics: list[dict]):
    from rich.table import Table

    table = Table(title="metrics", title_justify="left")
    for column in ("epoch", "train loss", "val loss", "val acc", "img/s"):
        table.add_column(column, justify="right")
    for row in metrics:
        table.add_row(
            str(row.get("epoch", "?")),
            f"{row.get('train_loss', float('nan')):.4f}",
            f"{row.get('val_loss', float('nan')):.4f}",
            f"{100 * row.get('val_acc', float('nan')):.2f}%",
            f"{row.get('images_per_sec', 0):.0f}",
        )
    return table


STATUS_MARKS = {"pass": "[green]pass[/green]", "fail": "[red]FAIL[/red]", "skip": "[dim]skip[/dim]"}


def show_checks(report: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"verify {report['path']}", title_justify="left")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail")
    for check in report["checks"]:
        table.add_row(check["check"], STATUS_MARKS[check["status"]], escape(check["detail"]))
    ui.console.print(table)
