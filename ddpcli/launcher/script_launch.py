"""`ddpcli launch`: a user's script on ddpcli's launcher, as torchrun would run it.

The same torch.distributed.elastic agent as `ddpcli train`
(ddpcli.launcher.engine.run_workers): every worker gets torchrun's environment and runs the
script through `ddpcli.launcher.bootstrap`. What the machine can tell is checked first (the
script, GPUs, interface, master port): exit 2 there, before any worker starts.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import uuid
from pathlib import Path

from ddpcli.collectives.gather import KEPT_FOLDER
from ddpcli.config import ScriptLaunchConfig
from ddpcli.errors import DdpcliError, usage_error
from ddpcli.files import folder_write_problem
from ddpcli.launcher.engine import (
    STORE_PER_ROUND,
    JobStopped,
    WorkerJob,
    job_membership,
    run_workers,
    worker_environment,
)
from ddpcli.launcher.resolve import check_torch_sees_gpus
from ddpcli.machine import check_gpu_indices, check_interface, granted_gpus, physical_gpu_count
from ddpcli.network import port_holder, port_is_free

BOOTSTRAP_MODULE = "ddpcli.launcher.bootstrap"
CPU_PROCESSES = 2  # with no GPU and no --nproc, as `ddpcli train` does


def resolve_script_launch(cfg: ScriptLaunchConfig) -> ScriptLaunchConfig:
    """Without --gpus or --nproc: one process per GPU this shell may use (torchrun's workers
    pick theirs from LOCAL_RANK), else CPU_PROCESSES processes. A CUDA_VISIBLE_DEVICES set
    by a scheduler (or a user) grants some: one process each, as `ddpcli train` does."""
    if cfg.gpus or cfg.nproc is not None:
        return cfg
    count = physical_gpu_count()
    granted = granted_gpus(count) if count else None
    if granted is None:
        return cfg.model_copy(update={"nproc": count or CPU_PROCESSES})
    if not granted:  # "-1" or "": every GPU hidden, as CUDA reads it
        return cfg.model_copy(update={"nproc": CPU_PROCESSES})
    return cfg.model_copy(update={"gpus": granted})


def check_before_start(cfg: ScriptLaunchConfig) -> None:
    """The rows `ddpcli check-env` would fail on for this launch, and the target itself."""
    check_target(cfg)
    check_gpu_indices(cfg.gpus, cpu_alternative="--nproc N without --gpus")
    # As train's: each worker would find no CUDA and, in most scripts, train on the CPU unseen.
    check_torch_sees_gpus(
        len(cfg.gpus or []), on_the_cpu="run CPU processes with --nproc N without --gpus"
    )
    if cfg.ifname:
        check_interface(cfg.ifname)
    if cfg.log_dir is not None:
        check_log_dir(cfg.log_dir)
    # --standalone is one node: its agent listens on --master-port when one is given.
    if cfg.master_port is not None and cfg.node_rank == 0 and not cfg.elastic:
        check_master_port(cfg.master_port)


def check_target(cfg: ScriptLaunchConfig) -> None:
    if cfg.module:
        check_module(cfg.target)
        return
    script = Path(cfg.target)
    if script.is_dir() and not (script / "__main__.py").is_file():
        raise usage_error(
            f"invalid SCRIPT: {script} is a folder without __main__.py; give a Python file, a "
            "folder with __main__.py, or -m MODULE"
        )
    if not script.exists():
        raise usage_error(
            f"invalid SCRIPT: {script} does not exist; give a Python file, or -m MODULE"
        )


def check_module(name: str) -> None:
    """Found as `python -m NAME` finds it in the workers: the working folder first on the
    path (the `ddpcli` program's own path starts with its bin folder instead)."""
    sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path.remove(os.getcwd())
    if not found:
        raise usage_error(
            f"no module named {name!r} here: run from the folder that holds it, or put it on "
            "PYTHONPATH"
        )


def check_log_dir(log_dir: str) -> None:
    """The agent makes --log-dir's folders as the workers start: a file there, or a
    read-only place, would end the launch in a traceback."""
    problem = folder_write_problem(Path(log_dir))
    if problem:
        raise usage_error(f"invalid --log-dir: cannot write in {log_dir}: {problem}; give a folder")


def check_master_port(port: int) -> None:
    """Node 0's agent listens there: a port taken now fails the launch in the rendezvous."""
    if port_is_free(port):
        return
    holder = port_holder(port)
    by = f" by {holder}" if holder else ""
    raise usage_error(
        f"invalid --master-port: {port} is in use on this machine{by}; pick another, or leave "
        "it out on one node (a free port is picked)"
    )


def records_folder(cfg: ScriptLaunchConfig) -> Path:
    """Where the ranks' flight records are kept if the job stops with ranks that no longer
    agree (made only then): --log-dir's collectives/, else a folder of its own in the
    temporary directory, which the verdict names."""
    if cfg.log_dir:
        return Path(cfg.log_dir) / KEPT_FOLDER
    return Path(tempfile.gettempdir()) / f"ddpcli-collectives-{uuid.uuid4().hex[:8]}"


def script_job(cfg: ScriptLaunchConfig) -> WorkerJob:
    target = ["-m", cfg.target] if cfg.module else [cfg.target]
    membership = job_membership(cfg)  # --standalone: one node, on --master-port if given
    return WorkerJob(
        module=BOOTSTRAP_MODULE,
        args=[*target, *cfg.script_args],
        nproc_per_node=cfg.nproc_per_node,
        **membership,
        env={**worker_environment(cfg.gpus, cfg.nproc_per_node, cfg.ifname), **restart_safe(cfg)},
        log_dir=cfg.log_dir,
        timeout_bounds_collectives=False,
        stacks_to_report=True,
        redirects=cfg.redirects,
        tee=cfg.tee,
        local_ranks_filter=cfg.local_ranks_filter,
        rdzv_settings=cfg.rdzv_conf,
        role=cfg.role,
        monitor_interval=cfg.monitor_interval,
        local_addr=cfg.local_addr,
        flight_recorder=cfg.flight_recorder,
        records_kept_in=records_folder(cfg),
        # The nodes' agents compare these at the roll call: a job is one script, one size.
        settings={
            "script": " ".join([*target, *cfg.script_args]),
            "nproc_per_node": str(cfg.nproc_per_node),
            "max_restarts": str(cfg.max_restarts),
        },
    )


def restart_safe(cfg: ScriptLaunchConfig) -> dict[str, str]:
    """Where workers may start again (--max-restarts, or a membership change), a store per
    round (ddpcli.launcher.engine.STORE_PER_ROUND): on the lent one, restarted Gloo ranks failed
    to connect in 1 restart of 3 here, as under torchrun."""
    if cfg.max_restarts == 0 and not cfg.elastic:
        return {}  # one round: the lent store is safe, and needs no free port picked
    return STORE_PER_ROUND


def launch_script(cfg: ScriptLaunchConfig, debug: bool = False) -> None:
    """Run the script on every worker and wait: exit 1 naming the first rank that failed,
    130 after Ctrl-C, with every worker stopped either way."""
    job = script_job(cfg)
    try:
        run_workers(job, debug)
    except JobStopped as stopped:
        raise DdpcliError(
            f"{stopped.signal_words}: stopped the {job.nproc_per_node} worker(s) of "
            f"{cfg.target} on this node",
            stopped.exit_code,
        ) from None
