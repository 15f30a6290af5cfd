"""`ddpcli bench-barrier`: flags -> one validated BarrierConfig -> the ranks -> a report.

The report goes to stderr as tables and a timeline, or to stdout as JSON with --json.
No torch here: the engine (ddpcli.barrier) is imported when the command runs.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from ddpcli import ui
from ddpcli.cli.app import _state, app, run_command
from ddpcli.cli.options import setting
from ddpcli.config import BarrierConfig
from ddpcli.config.barrier import DEFAULT_STAGGER_S, DEFAULT_WORK_S, SIZE_UNITS

DEMO = "Demo"
MEASURE = "Measurements"
PROCS = "Processes and devices"
TIMELINE_WIDTH = 50
TIMELINE_SYMBOLS = {"work": ("█", "cyan"), "wait": ("░", "yellow")}
PERCENTILES = ("p50", "p90", "p99", "max")
DEFAULT_SIZES = BarrierConfig.model_fields["sizes"].get_default(call_default_factory=True)


def size_text(size: int) -> str:
    """A byte count as --sizes takes it: 1048576 -> 1M."""
    for unit in ("G", "M", "K"):
        if size % SIZE_UNITS[unit] == 0:
            return f"{size // SIZE_UNITS[unit]}{unit}"
    return str(size)


def barrier_option(
    name: str, help: str | None = None, panel: str | None = None, default: str | None = None
) -> Any:
    """`--NAME` for BarrierConfig's field NAME: help shows its default (or DEFAULT, in words)."""
    return setting(BarrierConfig, name, help, panel=panel, default=default)


@app.command("bench-barrier", no_args_is_help=False)
def bench_barrier(
    nproc: Annotated[
        int | None,
        barrier_option("nproc", "CPU ranks.", PROCS, default="2, or one per --gpus GPU"),
    ] = None,
    backend: Annotated[
        str | None, barrier_option("backend", "auto: nccl with --gpus, else gloo.", PROCS)
    ] = None,
    gpus: Annotated[
        str | None,
        barrier_option(
            "gpus", "Physical GPU indices, one rank each: 0,3.", PROCS, default="none: the CPU"
        ),
    ] = None,
    sleeps: Annotated[
        str | None,
        barrier_option(
            "sleeps", "Seconds each rank sleeps, one per rank: 3,5.", DEMO, default="from --stagger"
        ),
    ] = None,
    stagger: Annotated[
        float | None,
        barrier_option(
            "stagger",
            "Rank r sleeps STAGGER x r seconds.",
            DEMO,
            default=f"{DEFAULT_STAGGER_S:g}; zero-first: every rank works {DEFAULT_WORK_S:g} s",
        ),
    ] = None,
    demo: Annotated[
        str | None,
        barrier_option(
            "demo",
            "staggered: rank r sleeps its share, then calls barrier(); zero-first: rank 0 works "
            "while the others wait; none: measurements only.",
            DEMO,
        ),
    ] = None,
    skip_rank: Annotated[
        int | None,
        barrier_option(
            "skip_rank", "Rank R skips the barrier: see the hang.", DEMO, default="none"
        ),
    ] = None,
    timeout: Annotated[
        float | None, barrier_option("timeout", "Seconds to wait at the barrier.", DEMO)
    ] = None,
    iters: Annotated[
        int | None, barrier_option("iters", "Timed barriers per rank.", MEASURE)
    ] = None,
    warmup: Annotated[
        int | None, barrier_option("warmup", "Untimed operations first.", MEASURE)
    ] = None,
    collective: Annotated[
        str | None,
        barrier_option(
            "collective",
            "Also time these collectives (--sizes alone: all_reduce).",
            MEASURE,
            default="none",
        ),
    ] = None,
    sizes: Annotated[
        str | None,
        barrier_option(
            "sizes",
            "Message sizes for --collective (K, M, G: powers of 1024).",
            MEASURE,
            default=",".join(map(size_text, DEFAULT_SIZES)),
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Watch barrier() line ranks up; time barriers, collectives.

    The staggered or zero-first demo shows each rank's arrival and departure; --skip-rank
    shows a skipped barrier hang; then p50/p90/p99 latency, and nccl-tests bandwidth for
    --collective."""
    flags = {key: value for key, value in locals().items() if key != "json_output"}
    if flags["sizes"] is not None and flags["collective"] is None:
        flags["collective"] = "all_reduce"  # sizes only mean something for a collective

    def action() -> None:
        from ddpcli.config import build_barrier_config
        from ddpcli.environments import read_launcher_env
        from ddpcli.errors import debug_requested

        if not debug_requested(_state["debug"]):
            # Gloo logs its own timeout errors; the summary says the same, once. Set before
            # the fork server imports torch, which reads it then and never again.
            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

        launcher = read_launcher_env()
        if launcher is not None and flags["nproc"] is None and flags["gpus"] is None:
            flags["nproc"] = launcher.world_size  # torchrun decided; --sleeps must match it
        cfg = build_barrier_config(flags)
        from ddpcli.barrier import BARRIER_WORKER_MODULE
        from ddpcli.launcher.engine import early_fork_server

        # The fork server imports torch while this process does.
        with early_fork_server(BARRIER_WORKER_MODULE, cfg.uses_gpus, launcher):
            from ddpcli.barrier.hang import BarrierHang
            from ddpcli.barrier.run import run_bench

            on_start = None if json_output else (lambda: announce(cfg))
            try:
                report = run_bench(cfg, debug=_state["debug"], on_start=on_start)
            except BarrierHang as hang:
                if json_output:
                    ui.print_json(hang.report)
                raise
        if report is None:  # a rank other than 0 under torchrun: rank 0 reports
            return
        if json_output:
            ui.print_json(report)
        else:
            show_report(report)

    run_command(action)


def announce(cfg) -> None:
    gpus = ",".join(map(str, cfg.gpus or []))
    where = f"{cfg.resolved_backend} on GPUs {gpus}" if cfg.gpus else "gloo on the CPU"
    plan = []
    if cfg.demo != "none":
        seconds = ", ".join(f"{value:g}" for value in cfg.sleeps_per_rank)
        doing = "sleep" if cfg.demo == "staggered" else "work"
        plan.append(f"{cfg.demo} demo (ranks {doing} {seconds} s)")
    if cfg.skip_rank is None:
        plan.append(f"{cfg.iters} timed barriers")
    if cfg.collective and cfg.skip_rank is None:
        plan.append(", ".join(cfg.collective))
    ui.info(f"starting {rank_count(cfg.world_size)} ({where}): " + ", then ".join(plan))
    if cfg.skip_rank is not None:
        ui.info(
            f"rank {cfg.skip_rank} will skip the barrier; the others should give up after "
            f"{cfg.timeout:g} s and say where they wait"
        )


# --- The human report ----------------------------------------------------------------------


def show_report(report: dict) -> None:
    ui.info(f"{rank_count(report['world_size'])} · {report['backend']} on {report['device']}")
    ui.info(f"barrier: {report['barrier']}")
    if report["ranks"]:
        show_demo(report)
    show_latency(report)
    if report["collectives"]:
        show_collectives(report)


def show_demo(report: dict) -> None:
    rows = report["ranks"]
    zero_first = report["demo"] == "zero-first"
    if zero_first:
        title = "zero-first demo: the others wait at barrier() while rank 0 works, then it joins"
    else:
        title = "staggered demo: rank r sleeps its share, then calls barrier()"
    table = titled_table(title)
    table.add_column("rank", justify="right")
    table.add_column("works s" if zero_first else "sleeps s", justify="right")
    if zero_first:
        table.add_column("work start s", justify="right")
        table.add_column("work end s", justify="right")
    for name in ("arrives s", "leaves s", "waited s"):
        table.add_column(name, justify="right")
    for row in rows:
        cells = [str(row["rank"]), f"{row['sleep_s']:g}"]
        if zero_first:
            cells += [f"{row['work_start_s']:.3f}", f"{row['work_end_s']:.3f}"]
        cells += [f"{row[key]:.3f}" for key in ("arrive_s", "leave_s", "wait_s")]
        table.add_row(*cells)
    ui.console.print(table)
    for line in timeline(rows):
        ui.console.print(line)
    ui.info(demo_verdict(report))
    ui.info(
        "times are seconds since a common start, on rank 0's clock (offsets measured over "
        f"the process group, good to ±{report['clock_error_ms']:.3f} ms)"
    )


def timeline(rows: list[dict]) -> list[Text]:
    """One line per rank: █ working (or sleeping), ░ waiting at the barrier, ┃ leaving it."""
    end = max(max(row["leave_s"], row.get("work_end_s", 0.0)) for row in rows)
    span = max(end * 1.04, 0.01)
    scale = (TIMELINE_WIDTH - 1) / span

    def column(seconds: float) -> int:
        return min(TIMELINE_WIDTH - 1, max(0, round(seconds * scale)))

    lines = [Text("  █ working  ░ waiting at the barrier  ┃ leaves it", style="dim")]
    for row in rows:
        cells = [(" ", "")] * TIMELINE_WIDTH
        work = (row.get("work_start_s", row["start_s"]), row.get("work_end_s", row["arrive_s"]))
        for kind, (start, end) in (("work", work), ("wait", (row["arrive_s"], row["leave_s"]))):
            for index in range(column(start), column(end)):
                cells[index] = TIMELINE_SYMBOLS[kind]
        cells[column(row["leave_s"])] = ("┃", "bold")
        line = Text(f"  rank {row['rank']:<3} ")
        for symbol, style in cells:
            line.append(symbol, style=style)
        lines.append(line)
    axis_end = f"{span:.2f} s"
    lines.append(
        Text(" " * 11 + "0 s".ljust(TIMELINE_WIDTH - len(axis_end)) + axis_end, style="dim")
    )
    return lines


def demo_verdict(report: dict) -> str:
    if report["world_size"] == 1:
        return "one rank: barrier() returns at once, there is nobody to wait for"
    if report["demo"] == "zero-first":
        order = report["zero_first"]
        first_other = order["others_first_work_start_s"]
        verdict = "before" if order["rank0_finished_first"] else "NOT before"
        return (
            f"rank 0's work ended at {order['rank0_work_end_s']:.3f} s, {verdict} any other "
            f"rank's work started (the first at {first_other:.3f} s)"
        )
    last = report["last_arrival"]
    leave = max(row["leave_s"] for row in report["ranks"])
    return (
        f"all {report['world_size']} ranks left together at {leave:.3f} s (within "
        f"{report['leave_spread_ms']:.2f} ms of each other), when the last to arrive, "
        f"rank {last['rank']}, got there at {last['arrive_s']:.3f} s"
    )


def show_latency(report: dict) -> None:
    overall = report["latency_us"]
    table = titled_table(
        f"barrier latency in µs: {overall['iters']} barriers timed on each rank after "
        f"{overall['warmup']} warm-up"
    )
    for name in ("rank", *PERCENTILES):
        table.add_column(name, justify="right")
    for row in report["latency_us_per_rank"]:
        table.add_row(str(row["rank"]), *(f"{row[key]:.1f}" for key in PERCENTILES))
    table.add_row("all", *(f"{overall[key]:.1f}" for key in PERCENTILES), style="bold")
    ui.console.print(table)


def show_collectives(report: dict) -> None:
    table = titled_table(
        "collectives, as nccl-tests measures them (float32, time averaged over ranks)"
    )
    for name in ("collective", "size", "count", "iters", "time µs", "algbw GB/s", "busbw GB/s"):
        table.add_column(name, justify="left" if name == "collective" else "right")
    for row in report["collectives"]:
        table.add_row(
            row["collective"],
            ui.byte_size(row["size_bytes"]),
            str(row["count"]),
            str(row["iters"]),
            f"{row['time_us']:.1f}",
            bandwidth_text(row["algbw_GBps"]),
            bandwidth_text(row["busbw_GBps"]),
        )
    ui.console.print(table)
    if report["world_size"] == 1:
        ui.info(
            "bandwidth n/a: a collective of one rank moves no data, so it has no bandwidth (the "
            "time is the call's own cost); run 2 or more ranks (--nproc, --gpus) to measure it"
        )
        return
    ui.info(
        "algbw = size / time; busbw = algbw x 2(n-1)/n for all_reduce, (n-1)/n for "
        "all_gather, 1 for broadcast (n ranks), so figures compare with nccl-tests'"
    )


def bandwidth_text(gbps: float | None) -> str:
    return "n/a" if gbps is None else f"{gbps:.3f}"


def titled_table(title: str) -> Table:
    """The title goes above as a line of its own: a table title wraps to the table's width."""
    ui.console.print(Text(title, style="bold"))
    return Table()


def rank_count(world_size: int) -> str:
    return f"{world_size} rank" + ("s" if world_size != 1 else "")
