"""`ddpcli check-env`: run it on every node before a multi-GPU or multi-node job.

Flags -> CheckEnvOptions -> checkenv.checks.run_checks, then with --probe
checkenv.probe.run_probe on the checks' facts -> a table on stderr (or JSON on stdout).
Exit 0 when every check passes, 1 when one fails (so it can gate a job script), 2 for bad
input such as an interface that does not exist.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

from ddpcli import ui
from ddpcli.cli.app import _state, app, run_command
from ddpcli.cli.options import choice_metavar, option
from ddpcli.config import Backend

if TYPE_CHECKING:
    from rich.table import Table

    from ddpcli.checkenv.report import Report, Row
    from ddpcli.config import CheckEnvOptions

NODES = "Multi-node"
PROBE = "Probe"
STATUS_STYLES = {"ok": "green", "warn": "yellow", "fail": "bold red"}


@app.command("check-env", no_args_is_help=False)
def check_env(
    ifname: Annotated[
        str | None,
        option(
            "Interface the run will use (GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME).", default="none"
        ),
    ] = None,
    master_addr: Annotated[
        str | None,
        option("Node 0's address.", default="MASTER_ADDR, else 127.0.0.1", panel=NODES),
    ] = None,
    master_port: Annotated[
        int | None,
        option(
            "Master port.",
            default="MASTER_PORT, else 29500; a one-node probe picks a free one",
            panel=NODES,
        ),
    ] = None,
    backend: Annotated[
        str | None,
        option(
            "auto: nccl where there are GPUs, else gloo.",
            default="auto",
            metavar=choice_metavar(Backend),
        ),
    ] = None,
    probe: Annotated[
        bool,
        typer.Option(
            "--probe",
            help="Run a real collective among local processes (and across nodes).",
            rich_help_panel=PROBE,
        ),
    ] = False,
    nproc: Annotated[
        int | None,
        option("Probe processes on this node.", default="one per GPU, else 2", panel=PROBE),
    ] = None,
    nnodes: Annotated[int | None, option("Nodes in the job.", default="1", panel=NODES)] = None,
    node_rank: Annotated[
        int | None, option("This node's rank, 0..nnodes-1.", default="0", panel=NODES)
    ] = None,
    timeout: Annotated[
        float | None,
        option("Seconds the probe waits for every node.", default="60", panel=PROBE),
    ] = None,
    stage_timeout: Annotated[
        float | None, option("Seconds for each probe stage.", default="15", panel=PROBE)
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check this node before a multi-GPU or multi-node run.

    Versions, GPUs, network interfaces, the master port; --probe runs a real all_reduce
    and barrier."""
    flags = {key: value for key, value in locals().items() if key != "json_output"}
    outcome: dict[str, bool] = {}

    def action() -> None:
        from ddpcli.errors import debug_requested

        if not debug_requested(_state["debug"]):
            # torch's C++ side logs every store retry with a stack; the rows say it better.
            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
        from ddpcli.config import build_check_options

        options = build_check_options(flags)
        report = check_node(options, progress=quiet if json_output else ui.info)
        show_report(report, json_output)
        outcome["failed"] = report.failed

    run_command(action)
    if outcome.get("failed"):
        raise typer.Exit(1)


def check_node(options: CheckEnvOptions, progress: Callable[[str], None]) -> Report:
    """Every check, then (--probe) the probe with the facts the checks read."""
    from ddpcli.checkenv.checks import run_checks

    report = run_checks(options)
    if not options.probe:
        return report
    from ddpcli.checkenv.probe import run_probe

    rows, document = run_probe(options, report.facts, report.master, progress)
    return report.with_probe(rows, document)


def quiet(message: str) -> None:
    """Progress is off with --json: stdout holds the document only."""


def show_report(report: Report, json_output: bool) -> None:
    if json_output:
        ui.print_json(report.to_json())
        return
    ui.console.print(report_table(report.rows))
    counts = report.counts
    summary = f"{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail"
    if report.failed:
        ui.console.print(f"[bold red]check-env: {summary}[/] · fix the failed rows and run again")
    else:
        ui.console.print(f"[green]check-env: {summary}[/]")


def report_table(rows: list[Row]) -> Table:
    from rich.markup import escape
    from rich.table import Table

    with_fixes = any(row.fix for row in rows)  # no empty column when everything passes
    table = Table(header_style="bold", pad_edge=False)
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail", overflow="fold", ratio=3)
    if with_fixes:
        table.add_column("what to do", overflow="fold", ratio=2)
    section = None
    for row in rows:
        if row.section != section:
            if section is not None:
                table.add_section()
            table.add_row(f"[bold]{escape(row.section)}[/bold]")
            section = row.section
        cells = [escape(row.name), f"[{STATUS_STYLES[row.status]}]{row.status}[/]"]
        cells.append(escape(row.detail))
        if with_fixes:
            cells.append(escape(row.fix))
        table.add_row(*cells)
    return table
