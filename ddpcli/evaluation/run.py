"""`ddpcli eval` in the launching process: under torchrun or SLURM this process is a rank
itself; else the devices resolved and the plan made (every exit 2) while the CPU ranks'
fork server imports the worker, then the ranks launched (ddpcli.evaluation.launch)."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from ddpcli.config.eval import EvalConfig
from ddpcli.environments import read_launcher_env
from ddpcli.evaluation.launch import EVAL_WORKER_MODULE, launch_ranks, with_devices
from ddpcli.launcher.fork import fork_server, forks_workers


def run_eval(cfg: EvalConfig, debug: bool = False) -> dict[str, Any] | None:
    """Rank 0's report; None on the other ranks of an outside launcher's world."""
    launcher = read_launcher_env()
    if launcher is not None:  # this process is a rank: no worker of its own to start
        from ddpcli.evaluation.plan import make_plan
        from ddpcli.evaluation.rank import run_rank

        return run_rank(cfg, make_plan(cfg), launcher)
    cfg = with_devices(cfg)
    # CPU ranks are forked from a server that imports the worker while the plan is made.
    server = fork_server(EVAL_WORKER_MODULE) if forks_workers(cfg.uses_gpus) else nullcontext()
    workdir = Path(tempfile.mkdtemp(prefix="ddpcli-eval-"))
    try:
        with server:
            # Here: the plan's module imports torch, which a server forked from this process
            # before it shares (ddpcli.launcher.fork).
            from ddpcli.evaluation.plan import make_plan

            return launch_ranks(cfg, make_plan(cfg), workdir, debug)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
