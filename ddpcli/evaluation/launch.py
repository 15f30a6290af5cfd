"""`ddpcli eval`'s launch: the devices resolved as `train` resolves them, the ranks started
on the launcher's engine (ddpcli.launcher.engine) with the plan handed to them, rank 0's
report read back. It lives here, not in launcher/, because the ranks are handed an EvalPlan
and leave their report under its RESULT_FILE (ddpcli.evaluation.plan)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpcli import ui
from ddpcli.collectives.gather import KEPT_FOLDER
from ddpcli.config.common import PER_NODE, settings_of_kind
from ddpcli.config.eval import EvalConfig
from ddpcli.launcher.engine import WorkerJob, job_membership, run_workers, worker_environment
from ddpcli.launcher.fork import forks_workers
from ddpcli.launcher.resolve import check_torch_sees_gpus, resolve_devices

if TYPE_CHECKING:  # the plan's module imports torch: after the fork server starts
    from ddpcli.evaluation.plan import EvalPlan

EVAL_WORKER_MODULE = "ddpcli.evaluation.worker"
# Settings each node may give its own way (its paths, devices, network: marked so on their
# fields); the rest must agree.
PER_NODE_SETTINGS = settings_of_kind(EvalConfig, PER_NODE)


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
        flight_recorder=cfg.flight_recorder,
        records_kept_in=cfg.resolved_out / KEPT_FOLDER,
    )
    run_workers(job, debug)
    from ddpcli.evaluation.plan import RESULT_FILE

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
