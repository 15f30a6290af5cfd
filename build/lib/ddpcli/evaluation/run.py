"""`ddpcli eval` in the launching process: the devices resolved as `train` resolves them,
the plan made (every exit 2), the ranks started as training's are, rank 0's report read.
Under torchrun or SLURM this process is a rank itself."""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from ddpcli import ui
from ddpcli.config.eval import EvalConfig
from ddpcli.environments import read_launcher_env
from ddpcli.evaluation.plan import RESULT_FILE, EvalPlan, make_plan
from ddpcli.launcher.fork import fork_server, forks_workers
from ddpcli.launcher.launch import WorkerJob, job_membership, run_workers, worker_environment
from ddpcli.launcher.resolve import check_torch_sees_gpus, resolve_devices

EVAL_WORKER_MODULE = "ddpcli.evaluation.worker"
# Settings each node may give its own way (its paths, devices, network); the rest must agree.
PER_NODE_SETTINGS = frozenset({
    "checkpoint", "data_dir", "out", "node_rank", "gpus", "workers", "ifname", "master_addr",
    "master_port", "init_method", "timeout",
})  # fmt: skip


def run_eval(cfg: EvalConfig, debug: bool = False) -> dict[str, Any] | None:
    """Rank 0's report; None on the other ranks of an outside launcher's world."""
    launcher = read_launcher_env()
    if launcher is not None:  # this process is a rank: no worker of its own to start
        from ddpcli.evaluation.rank import run_rank

        return run_rank(cfg, make_plan(cfg), launcher)
    cfg = with_devices(cfg)
    # CPU ranks are forked from a server that imports torch while the plan is made.
    server = fork_server(EVAL_WORKER_MODULE) if forks_workers(cfg.uses_gpus) else nullcontext()
    workdir = Path(tempfile.mkdtemp(prefix="ddpcli-eval-"))
    try:
        with server:
            return launch_ranks(cfg, make_plan(cfg), workdir, debug)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def with_devices(cfg: EvalConfig) -> EvalConfig:
    """No --gpus: every GPU, else 2 CPU processes, as `train` decides it."""
    values = cfg.model_dump()
    resolve_devices(values)
    resolved = cfg.model_copy(update={key: values[key] for key in ("cpu", "gpus", "nproc")})
    check_torch_sees_gpus(len(resolved.gpus or []) if not resolved.cpu else 0, "use --cpu")
    return resolved


def launch_ranks(cfg: EvalConfig, plan: EvalPlan, workdir: Path, debug: bool) -> dict[str, Any]:
    request = workdir / "request.json"
    request.write_text(json.dumps({"config": cfg.model_dump(mode="json"), "plan": vars(plan)}))
    gpus = cfg.gpus if cfg.uses_gpus else None
    job = WorkerJob(
        module=EVAL_WORKER_MODULE,
        args=[str(request), str(workdir)],
        nproc_per_node=cfg.nproc_per_node,
        fork=forks_workers(cfg.uses_gpus),
        **job_membership(cfg),
        env={
            **worker_environment(gpus, cfg.nproc_per_node, cfg.ifname),
            **({"DDPCLI_DEBUG": "1"} if debug else {}),
        },
        settings=settings_every_node_shares(cfg),
    )
    run_workers(job, debug)
    result = workdir / RESULT_FILE
    if cfg.node_rank == 0 and result.exists():
        return json.loads(result.read_text())
    ui.info(f"node {cfg.node_rank} finished; node 0 (rank 0) writes the outputs")
    return {"node_rank": cfg.node_rank}


def settings_every_node_shares(cfg: EvalConfig) -> dict[str, str]:
    document = cfg.model_dump(mode="json")
    return {
        name: value if isinstance(value, str) else json.dumps(value)
        for name, value in document.items()
        if name not in PER_NODE_SETTINGS
    }
