"""`ddpcli launch`: flags -> one validated ScriptLaunchConfig -> ddpcli.launcher.script_launch.

torchrun's spellings (`--nproc-per-node`, `--node_rank`, `--master_addr`, ...) name the same
options, so that `torchrun` can be replaced by `ddpcli launch` in a command line. Option
parsing stops at the script: everything after it is the script's.
"""

from __future__ import annotations

from typing import Annotated

import typer

from ddpcli.cli.app import _state, app, run_command
from ddpcli.cli.options import option

NODES = "Multi-node"
TORCHRUN = "torchrun's own"


def spellings(name: str, *more: str) -> tuple[str, ...]:
    """`--node-rank` and torchrun's `--node_rank` (and any further aliases)."""
    return (f"--{name}", f"--{name.replace('-', '_')}", *more)


@app.command(
    no_args_is_help=True,
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def launch(
    target: Annotated[
        str, typer.Argument(metavar="SCRIPT.py|MODULE", help="The script (or, with -m, module).")
    ],
    script_args: Annotated[
        list[str] | None, typer.Argument(metavar="[ARGS]...", help="The script's arguments.")
    ] = None,
    module: Annotated[
        bool,
        typer.Option("-m", "--module", help="Run MODULE as `python -m MODULE` would."),
    ] = False,
    gpus: Annotated[
        str | None,
        option(
            "Physical GPU indices, one process each (sets CUDA_VISIBLE_DEVICES): 0,3.",
            default="all GPUs (no CUDA_VISIBLE_DEVICES)",
        ),
    ] = None,
    nproc: Annotated[
        str | None,
        option(
            "Processes on this node: N, or torchrun's auto, gpu (one per GPU, else 2) or cpu "
            "(one per core).",
            default="one per GPU, else 2",
            decls=("--nproc", *spellings("nproc-per-node")),
        ),
    ] = None,
    nnodes: Annotated[
        str | None,
        option(
            "Nodes in the job: N, or MIN:MAX to run on as many as come (c10d, no --node-rank).",
            default="1",
            panel=NODES,
            decls=("--nnodes",),
        ),
    ] = None,
    node_rank: Annotated[
        int | None,
        option("This node's rank.", default="0", panel=NODES, decls=spellings("node-rank")),
    ] = None,
    master_addr: Annotated[
        str | None,
        option(
            "Node 0's address.", default="127.0.0.1", panel=NODES, decls=spellings("master-addr")
        ),
    ] = None,
    master_port: Annotated[
        int | None,
        option(
            "Node 0's agent port.",
            default="a free port on one node; 29500 on several",
            panel=NODES,
            decls=spellings("master-port"),
        ),
    ] = None,
    rdzv_backend: Annotated[
        str | None,
        option(
            "static (fixed --node-rank) or c10d (any order, no ranks).",
            default="c10d for --nnodes MIN:MAX, else static",
            panel=NODES,
            decls=spellings("rdzv-backend"),
        ),
    ] = None,
    rdzv_endpoint: Annotated[
        str | None,
        option(
            "HOST[:PORT] where the nodes meet; the host that holds this address serves it.",
            default="--master-addr:--master-port",
            panel=NODES,
            decls=spellings("rdzv-endpoint"),
        ),
    ] = None,
    rdzv_id: Annotated[
        str | None,
        option(
            "The job's name in the rendezvous.",
            default="ddpcli",
            panel=NODES,
            decls=spellings("rdzv-id"),
        ),
    ] = None,
    standalone: Annotated[
        bool,
        typer.Option(
            "--standalone", help="One node on a free port (torchrun's flag; the default here)."
        ),
    ] = False,
    ifname: Annotated[
        str | None,
        option(
            "Network interface for Gloo/NCCL (sets GLOO_/NCCL_SOCKET_IFNAME).",
            default="the one Gloo/NCCL pick",
            panel=NODES,
            decls=("--ifname",),
        ),
    ] = None,
    max_restarts: Annotated[
        int | None,
        option(
            "Restart all workers up to N times when one fails.",
            default="0",
            decls=spellings("max-restarts"),
        ),
    ] = None,  # fmt: skip
    timeout: Annotated[
        float | None,
        option(
            "Seconds the nodes may take to meet.", default="300", panel=NODES, decls=("--timeout",)
        ),
    ] = None,  # fmt: skip
    log_dir: Annotated[
        str | None,
        option(
            "One log file per rank; the terminal shows rank 0 and every rank's errors.",
            default="none: the terminal",
            decls=spellings("log-dir"),
        ),
    ] = None,
    flight_recorder: Annotated[
        bool | None,
        option(
            "torch's flight recorder in every rank: when ranks stop agreeing, a verdict naming "
            "the rank, the collective and the line that issued it (records in --log-dir's "
            "collectives/, else a temporary folder).",
            default="on",
            decls=("--flight-recorder/--no-flight-recorder",),
        ),
    ] = None,
    redirects: Annotated[
        str | None,
        option(
            "Output of the workers into --log-dir's files: 0 none, 1 stdout, 2 stderr, 3 both; "
            "per rank: 0:3,1:2.",
            default="3 with --log-dir",
            panel=TORCHRUN,
            decls=("--redirects",),
        ),
    ] = None,
    tee: Annotated[
        str | None,
        option(
            "What the terminal also shows of the redirected output, as --redirects.",
            default="rank 0's output and every rank's errors",
            panel=TORCHRUN,
            decls=("--tee",),
        ),
    ] = None,
    local_ranks_filter: Annotated[
        str | None,
        option(
            "Local ranks whose output the terminal shows: 0,1.",
            default="all",
            panel=TORCHRUN,
            decls=spellings("local-ranks-filter"),
        ),
    ] = None,
    rdzv_conf: Annotated[
        str | None,
        option(
            "The rendezvous's settings: timeout=S (as --timeout), read_timeout=S, ...",
            panel=TORCHRUN,
            decls=spellings("rdzv-conf"),
        ),
    ] = None,
    monitor_interval: Annotated[
        float | None,
        option(
            "Seconds between the agent's looks at its workers.",
            default="0.1",
            panel=TORCHRUN,
            decls=spellings("monitor-interval"),
        ),
    ] = None,
    role: Annotated[
        str | None,
        option("The workers' role name.", panel=TORCHRUN, decls=("--role",)),
    ] = None,
    local_addr: Annotated[
        str | None,
        option(
            "The address this node gives the others at the c10d rendezvous.",
            default="--ifname's, else the route's",
            panel=TORCHRUN,
            decls=spellings("local-addr"),
        ),
    ] = None,
    start_method: Annotated[
        str | None,
        option(
            "Taken, without effect: a script's workers are programs, as under torchrun.",
            panel=TORCHRUN,
            decls=spellings("start-method"),
        ),
    ] = None,
    run_path: Annotated[
        bool | None,
        typer.Option(
            "--run-path",
            "--run_path",
            help="Taken: every worker runs the script with runpy anyway.",
            rich_help_panel=TORCHRUN,
        ),
    ] = None,
) -> None:
    """Run a training script on N processes, as torchrun does.

    Each worker gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT). On failure it names the first rank that failed, how, and its
    last lines, and stops every worker. torchrun's spellings of the flags work too."""
    flags = {**locals(), "script_args": script_args or []}

    def action() -> None:
        from ddpcli.config import build_launch_config
        from ddpcli.launcher.script_launch import (
            check_before_start,
            launch_script,
            resolve_script_launch,
        )

        cfg = resolve_script_launch(build_launch_config(flags))
        check_before_start(cfg)
        launch_script(cfg, debug=_state["debug"])

    run_command(action)
