"""`ddpcli data pack|verify`: a data set into WebDataset-format tar shards and their index,
and the shards checked against it.

The engine (ddpcli.data.shards) returns plain data; this module shows it: a progress bar
and a table on stderr for people, one JSON document on stdout with `--json`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from ddpcli import ui
from ddpcli.cli.app import data_app, run_command
from ddpcli.cli.options import option
from ddpcli.config.data import DEFAULT_SHARD_SIZE, MAX_DEFAULT_WORKERS
from ddpcli.errors import runtime_error

OutFolder = Annotated[
    Path, typer.Argument(help="Folder of the shards and their index.json.", metavar="OUT")
]
# Text, not a Path: a Path would make s3://bucket/shards into s3:/bucket/shards.
ShardLocation = Annotated[
    str,
    typer.Argument(
        help="Folder of the shards and their index.json, or its URL (s3://, gs://, http(s)://).",
        metavar="OUT",
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
Workers = Annotated[
    int | None,
    option(
        "Processes that write or read shards.", default=f"CPU cores, {MAX_DEFAULT_WORKERS} at most"
    ),
]


@data_app.command("pack", no_args_is_help=True)
def pack(
    src: Annotated[
        Path,
        typer.Argument(
            help="An image folder (SRC/train/<class>/*, SRC/val/<class>/*) or STL-10 (the "
            "folder holding stl10_binary/).",
            metavar="SRC",
        ),
    ],
    out: OutFolder,
    shard_size: Annotated[
        str | None,
        option(
            "Bytes per shard, about: 256MB, 1G (K, M, G: powers of 1024).",
            default=DEFAULT_SHARD_SIZE,
            metavar="SIZE",
        ),
    ] = None,
    workers: Workers = None,
    seed: Annotated[
        int | None, option("Seed of the order samples are spread over shards in.", default="0")
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Replace the shards an earlier pack wrote in OUT (and only those)."
        ),
    ] = False,
    json_output: JsonFlag = False,
) -> None:
    """Pack a data set into WebDataset-format tar shards.

    Each sample is KEY.jpg|png (the file's own bytes; STL-10's pixels as lossless PNG) and
    KEY.cls (its class index); train-000000.tar, ..., val-000000.tar, ..., then
    OUT/index.json (classes, and each shard's samples, bytes and SHA-256). The same folder
    always packs into the same bytes."""

    def action() -> None:
        from ddpcli.config.data import build_pack_config
        from ddpcli.data.shards.pack import pack as pack_shards

        flags = {"src": src, "out": out, "shard_size": shard_size, "workers": workers}
        cfg = build_pack_config({**flags, "seed": seed, "force": force})
        with shard_progress("packing", enabled=not json_output) as (on_plan, on_shard):
            report = pack_shards(cfg, on_plan, on_shard)
        if json_output:
            ui.print_json(report)
        else:
            show_pack(report)

    run_command(action)


@data_app.command("verify", no_args_is_help=True)
def verify(out: ShardLocation, workers: Workers = None, json_output: JsonFlag = False) -> None:
    """Check every shard against OUT/index.json.

    Each shard the index names must be there, whole, with the same SHA-256 and the same
    number of samples. OUT may be a URL: each shard is then streamed, not copied to disk.
    Exit 1 naming each bad shard; exit 2 if OUT holds no index."""

    def action() -> None:
        from ddpcli.config.data import build_verify_config
        from ddpcli.data.shards.verify import verify as verify_shards

        cfg = build_verify_config({"out": out, "workers": workers})
        with shard_progress("verifying", enabled=not json_output) as (on_plan, on_check):
            report = verify_shards(cfg, on_plan, on_check)
        if json_output:
            ui.print_json(report)
        else:
            show_verify(report)
        if report["bad"]:
            raise runtime_error(
                f"{len(report['bad'])} of {len(report['shards'])} shards in {report['out']} "
                "are bad: "
                + "; ".join(
                    f"{check['name']} ({check['status']}: {check['detail']})"
                    for check in report["shards"]
                    if check["status"] != "ok"
                )
            )

    run_command(action)


# Off a terminal (a job's log), a line this often instead of a bar.
LOG_EVERY_S = 30.0


@contextmanager
def shard_progress(verb: str, enabled: bool) -> Iterator[tuple[Any, Any]]:
    """Shards done: a bar on a terminal (stderr), a line every LOG_EVERY_S seconds in a log,
    nothing with --json. Yields the engine's two callbacks: the number of shards, then one
    call per shard done."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    live = enabled and ui.console.is_terminal
    bar = Progress(
        TextColumn(f"{verb} shards"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=ui.console,
        transient=True,
        disable=not live,
    )
    task = bar.add_task(verb, total=None)
    logged = {"at": time.monotonic()}

    def advance(result: Any) -> None:
        bar.advance(task)
        if enabled and not live and time.monotonic() - logged["at"] >= LOG_EVERY_S:
            logged["at"] = time.monotonic()
            state = bar.tasks[0]
            ui.info(f"{verb} shards: {state.completed:.0f}/{state.total or 0:.0f}")

    with bar:
        yield (lambda shards: bar.update(task, total=shards), advance)


def show_pack(report: dict[str, Any]) -> None:
    for name, split in report["splits"].items():
        ui.info(
            f"{name}: {split['samples']:,} samples of {split['classes']} classes in "
            f"{split['shards']} shards ({ui.byte_size(split['bytes'])})"
        )
    if report["removed_stale_shards"]:
        ui.info(f"removed {len(report['removed_stale_shards'])} shards of the earlier pack")
    ui.info(f"wrote {report['index']} in {report['seconds']:.1f} s")


def show_verify(report: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    bad_by_split: dict[str, int] = {}
    for check in report["shards"]:
        if check["status"] != "ok":
            bad_by_split[check["split"]] = bad_by_split.get(check["split"], 0) + 1
    table = Table(title=f"verify {escape(report['out'])}", title_justify="left")
    for column in ("split", "shards", "samples", "size", "result"):
        table.add_column(column, justify="left" if column in ("split", "result") else "right")
    for name, split in report["splits"].items():
        bad = bad_by_split.get(name, 0)
        result = f"[red]{bad} bad[/red]" if bad else "[green]ok[/green]"
        size = ui.byte_size(split["bytes"])
        table.add_row(name, str(split["shards"]), f"{split['samples']:,}", size, result)
    ui.console.print(table)
