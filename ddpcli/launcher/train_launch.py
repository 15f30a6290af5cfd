"""`ddpcli train`'s launch: adopt a launcher's environment (this process is a rank), or
start the run's workers on the engine (ddpcli.launcher.engine) and read back rank 0's
summary, its word on a stop, or the failure every rank agreed on; the run's curves drawn
after it, whatever happened.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any

from ddpcli import ui
from ddpcli.collectives.gather import KEPT_FOLDER
from ddpcli.config.common import PER_NODE, settings_of_kind
from ddpcli.config.data import WITH_CREDENTIALS
from ddpcli.config.plan import RunPlan
from ddpcli.environments import LauncherEnv, read_launcher_env
from ddpcli.errors import DdpcliError, debug_requested
from ddpcli.files import write_text_atomic
from ddpcli.launcher.engine import (
    STORE_PER_ROUND,
    JobStopped,
    WorkerJob,
    job_membership,
    run_workers,
    worker_environment,
)
from ddpcli.launcher.failure_report import newest_run_log_dir
from ddpcli.launcher.fork import forks_workers
from ddpcli.launcher.resources import capacity_warnings
from ddpcli.outputs.runfolder import claim_run_folder
from ddpcli.outputs.summary import SUMMARY_FILE, OtherNode, RunSummary
from ddpcli.process import freeze_imported_objects
from ddpcli.records import AGREED_STOP_FILE, PEER_FAILED_FILE

WORKER_MODULE = "ddpcli.training.worker"


def launch_train(cfg: RunPlan, debug: bool = False) -> RunSummary:
    """Run the training job and return rank 0's summary. The process on rank 0's side
    then draws the run's curves, also after a failure or Ctrl-C: a picture of what happened
    up to there, while it still holds the run folder."""
    freeze_imported_objects()
    launcher = read_launcher_env()
    draws = launcher.rank == 0 if launcher is not None else cfg.node_rank == 0
    with claim_run_folder(cfg, launcher):
        try:
            summary = start_training(cfg, launcher, debug)
        except BaseException:
            if draws:
                draw_curves_after_stop(cfg.out)
            raise
        if draws and summary.stop is not None:  # Ctrl-C or a preemption, said by the workers
            draw_curves_after_stop(cfg.out)
        elif draws and (picture := draw_curves(cfg.out)):
            summary = dataclasses.replace(summary, curves=str(picture))
        return summary


def draw_curves(out: Path) -> Path | None:
    """OUT/curves.png; a picture that cannot be drawn is a warning, never a failed run."""
    from ddpcli.outputs.curves import write_run_curves

    try:
        return write_run_curves(out)
    except Exception as error:  # the run itself is what counts: say so, go on
        ui.warn(f"could not draw {out / 'curves.png'}: {type(error).__name__}: {error}")
        return None


def draw_curves_after_stop(out: Path) -> None:
    picture = draw_curves(out)
    if picture is not None:
        ui.info(f"curves up to where the run stopped: {picture}")


def start_training(cfg: RunPlan, launcher: LauncherEnv | None, debug: bool) -> RunSummary:
    if launcher is None:
        return _launch_elastic(cfg, debug)
    if cfg.gpus and launcher.rank == 0:
        ui.warn("--gpus is ignored under a launcher: each rank uses the GPU of its LOCAL_RANK")
    if cfg.ifname:  # this process is the worker: set them before its group forms
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = cfg.ifname
    if joining := launcher.joining(cfg.timeout, cfg.init_method):  # said before it waits
        ui.info(joining)
    return run_adopted_worker(cfg, launcher, debug)


def run_adopted_worker(cfg: RunPlan, launcher: LauncherEnv, debug: bool) -> RunSummary:
    """This process is a rank of the launcher's world. A failed rank reports and ends at
    once, as our own workers do: its live process group is never torn down (that can wait
    for the other ranks' watchdogs) nor left to the interpreter's exit (Gloo can abort)."""
    from ddpcli.training.worker import exit_for_error, run_worker

    try:
        return run_worker(cfg, launcher)
    except Exception as error:
        if debug_requested(debug):
            traceback.print_exc()
        agreed = isinstance(error, DdpcliError) and error.every_rank
        exit_for_error(error, launcher.rank, speaks=launcher.rank == 0 or not agreed)


def _launch_elastic(cfg: RunPlan, debug: bool) -> RunSummary:
    out = cfg.out
    for warning in capacity_warnings(cfg):
        ui.warn(warning)
    summary_file = out / SUMMARY_FILE  # rank 0 writes it, and rank 0 runs on node 0
    if cfg.node_rank == 0:
        summary_file.unlink(missing_ok=True)
    # The config the workers read is this launch's alone: in a folder of its own, removed
    # when the launch ends (in --out, a second run could rewrite it before they read it).
    with tempfile.TemporaryDirectory(prefix="ddpcli-launch-") as private:
        request = Path(private) / "config.json"
        # The one copy that keeps a --data-dir URL's user:password@: its workers read with it.
        request.write_text(cfg.model_dump_json(context={WITH_CREDENTIALS: True}))
        job = WorkerJob(
            module=WORKER_MODULE,
            args=[str(request), str(out)],  # the second names the run for `ps`, unread
            nproc_per_node=cfg.nproc_per_node,
            fork=forks_workers(cfg.uses_gpus),
            **job_membership(cfg),
            env={**train_environment(cfg), **({"DDPCLI_DEBUG": "1"} if debug else {})},
            log_dir=str(cfg.log_dir) if cfg.log_dir else None,
            settings=settings_every_node_shares(cfg),
            peer_failed_notice=Path(private) / PEER_FAILED_FILE,
            stacks_dir=Path(private),
            flight_recorder=cfg.flight_recorder,
            records_kept_in=out / KEPT_FOLDER,
        )
        try:
            run_workers(job, debug)
        except JobStopped as stopped:
            # The workers passed on the signal and ended: a Ctrl-C or a preemption inside
            # the loop left rank 0's word on where the run stopped.
            stop = read_stop_record(summary_file) if cfg.node_rank == 0 else None
            if stop is None:
                raise DdpcliError(
                    f"{stopped.signal_words}: every worker of this node stopped, none inside "
                    f"the training loop; --out {out} --resume auto continues from its last "
                    "checkpoint, if any",
                    stopped.exit_code,
                ) from None
            return stop
        except DdpcliError as failed:  # a failed rank (a JobStopped is caught above)
            agreed = read_agreed_stop(Path(private) / AGREED_STOP_FILE)
            said = failed if agreed is None else agreed_with_verdict(agreed, failed)
            if said.data and cfg.node_rank == 0:  # the verdict, for a script to read
                write_text_atomic(summary_file, ui.json_text(said.document()) + "\n")
            if agreed is None:
                raise
            raise said from None
    if job.log_dir:
        ui.info(f"per-rank logs: {newest_run_log_dir(job.log_dir)}/attempt_N/<local rank>/")
    if cfg.node_rank == 0 and summary_file.exists():
        return RunSummary.from_dict(json.loads(summary_file.read_text()))
    return RunSummary(other_node=OtherNode(str(out), cfg.node_rank))


def agreed_with_verdict(agreed: dict, failed: DdpcliError) -> DdpcliError:
    """The stop every rank agreed on (said once), with the verdict on the ranks'
    collectives FAILED carries, if any: a parameter unused on one rank only is both."""
    verdict = (failed.data or {}).get("verdict")
    lines = [f"  {line}" for line in verdict["lines"]] if verdict else []
    return DdpcliError("\n".join([agreed["failed"], *lines]), agreed["exit_code"], data=failed.data)


def read_stop_record(summary_file: Path) -> RunSummary | None:
    """Rank 0's summary when the run stopped early (Ctrl-C, a preemption), else None."""
    record = read_rank0_record(summary_file)
    summary = RunSummary.from_dict(record) if record is not None else None
    return summary if summary is not None and summary.stop is not None else None


def read_agreed_stop(record_file: Path) -> dict[str, Any] | None:
    """Rank 0's word on a stop every rank found together (a non-finite loss), else None."""
    record = read_rank0_record(record_file)
    return record if record is not None and "failed" in record else None


def read_rank0_record(path: Path) -> dict[str, Any] | None:
    """The JSON object rank 0 left for the launcher; None if missing, torn or not one."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def train_environment(cfg: RunPlan) -> dict[str, str]:
    gpus = cfg.gpus if cfg.uses_gpus else None
    env = worker_environment(gpus, cfg.nproc_per_node, cfg.ifname)
    # Restarts on a fixed membership keep the lent store: the workers key each attempt apart
    # (ddpcli.dist), which holds as long as every agent counts the same restarts.
    return {**env, **STORE_PER_ROUND} if cfg.elastic else env


# Settings each node may give its own way (marked so on their fields): its files, its devices
# and network interface, how it reaches node 0, how long it waits. Everything else in the plan
# changes the job (its world, its arithmetic, when its ranks meet) and must agree.
PER_NODE_SETTINGS = settings_of_kind(RunPlan, PER_NODE)


def settings_every_node_shares(cfg: RunPlan) -> dict[str, str]:
    document = cfg.model_dump(mode="json")
    document["nproc_per_node"] = cfg.nproc_per_node
    return {
        name: value if isinstance(value, str) else "unset" if value is None else json.dumps(value)
        for name, value in document.items()
        if name not in PER_NODE_SETTINGS
    }
