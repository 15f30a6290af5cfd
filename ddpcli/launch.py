"""Starting workers: adopt a launcher's environment, or start our own through
torch.distributed.elastic (the engine behind torchrun), which brings rendezvous,
restarts and per-rank error reports.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ddpcli import ui
from ddpcli.config import TrainConfig, cpu_count, read_launcher_env
from ddpcli.errors import USAGE, DdpcliError, runtime_error, usage_error

WORKER_MODULE = "ddpcli.worker"


def launch_train(cfg: TrainConfig, debug: bool = False) -> dict:
    """Run the training job and return rank 0's summary."""
    launcher = read_launcher_env()
    if launcher is not None:
        from ddpcli.worker import run_worker

        if cfg.gpus and launcher.rank == 0:
            ui.warn("--gpus is ignored under a launcher: each rank uses the GPU of its LOCAL_RANK")
        return run_worker(cfg, launcher)
    return _launch_elastic(cfg, debug)


def worker_environment(cfg: TrainConfig) -> dict[str, str]:
    """Variables the workers must inherit; set before any of them initialises CUDA."""
    env: dict[str, str] = {}
    if cfg.uses_gpus:
        # Physical indices -> the workers see only these, renumbered cuda:0.., cuda:N-1.
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index) for index in cfg.gpus)
    else:
        env["OMP_NUM_THREADS"] = str(max(1, cpu_count() // cfg.nproc_per_node))
    if cfg.ifname:
        env["GLOO_SOCKET_IFNAME"] = cfg.ifname
        env["NCCL_SOCKET_IFNAME"] = cfg.ifname
    return env


@dataclass
class WorkerJob:
    """What any command needs to start its local workers under the elastic agent."""

    module: str  # run as `python -m module *args` in every worker
    args: list[str]
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None on one node: a free port is picked
    timeout_s: float = 300.0
    max_restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None


def launch_config(job: WorkerJob):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    timeout = max(1, int(job.timeout_s))
    if job.nnodes == 1 and job.master_port is None:
        # Port 0: the rendezvous store binds a free port, so runs on one machine never collide.
        backend, endpoint, rdzv_configs = "c10d", "127.0.0.1:0", {"timeout": timeout}
    else:
        backend, endpoint = "static", f"{job.master_addr}:{job.master_port or 29500}"
        rdzv_configs = {"rank": job.node_rank, "timeout": timeout}
    prefix = None
    if job.log_dir:
        # Every rank's output in its own file; the console shows rank 0 and everyone's errors.
        tee = {rank: Std.ALL if rank == 0 else Std.ERR for rank in range(job.nproc_per_node)}
        logs = DefaultLogsSpecs(log_dir=job.log_dir, redirects=Std.ALL, tee=tee)
        prefix = "[${hostname} rank ${rank}] "
    else:
        logs = DefaultLogsSpecs()
    return LaunchConfig(
        min_nodes=job.nnodes,
        max_nodes=job.nnodes,
        nproc_per_node=job.nproc_per_node,
        run_id=f"ddpcli-{uuid.uuid4().hex[:8]}" if job.nnodes == 1 else "ddpcli",
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=job.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=logs,
        log_line_prefix_template=prefix,
        # No shutdown_timeout: with a short one (5 s, measured on torch 2.14) restarted
        # Gloo workers could not connect to each other again.
    )


def run_workers(job: WorkerJob, debug: bool = False) -> None:
    """Start `job` under torch.distributed.elastic and wait; a failed rank becomes a
    DdpcliError naming it (exit 2 if it failed on bad input, 1 otherwise)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if not debug:
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.update(job.env)  # inherited by the workers, before any of them starts CUDA
    store = roll_call(job) if job.nnodes > 1 else None  # noqa: F841 - keeps the server alive
    try:
        elastic_launch(launch_config(job), sys.executable)("-m", job.module, *job.args)
    except ChildFailedError as failure:
        raise describe_failure(failure) from None
    except Exception as error:  # rendezvous errors: the world never formed
        name = type(error).__name__
        if "Rendezvous" in name or "Timeout" in name:
            raise runtime_error(
                f"the job never formed: {name} after {job.timeout_s:g}s waiting for "
                f"{job.nnodes} node(s) at {job.master_addr}:{job.master_port}; start the same "
                "command on every node (only --node-rank differs) or raise --timeout"
            ) from error
        raise


ROLL_PREFIX = "ddpcli/roll/"


def roll_call(job: WorkerJob):
    """Before any worker starts, every node reports to node 0 on the master's store, so a
    node that never comes is named after --timeout instead of everyone waiting forever.
    Node 0 hosts the store (multi-tenant: the elastic agent's rendezvous reuses it)."""
    import datetime
    import time

    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=job.timeout_s)
    address = f"{job.master_addr}:{job.master_port}"
    if job.node_rank != 0:
        wait_for_port(job)
    try:
        store = TCPStore(
            job.master_addr, job.master_port, is_master=job.node_rank == 0,
            wait_for_workers=False, timeout=timeout, multi_tenant=True,
        )  # fmt: skip
    except (RuntimeError, OSError) as error:
        if job.node_rank == 0:
            raise usage_error(
                f"cannot listen on {address}: {first_line(error)}; pick another --master-port "
                "or check that --master-addr is an address of this machine"
            ) from None
        raise runtime_error(
            f"node {job.node_rank}: could not reach the master at {address} within "
            f"{job.timeout_s:g}s; start node 0 first, check the address and that the port is "
            "open (ddpcli check-env --master-addr ... --master-port ...)"
        ) from None
    store.set(f"{ROLL_PREFIX}{job.node_rank}", socket.gethostname())
    if job.node_rank != 0:
        return store
    deadline = time.monotonic() + job.timeout_s
    while True:
        present = [r for r in range(job.nnodes) if store.check([f"{ROLL_PREFIX}{r}"])]
        if len(present) == job.nnodes:
            return store
        if time.monotonic() > deadline:
            missing = [r for r in range(job.nnodes) if r not in present]
            raise runtime_error(
                f"only {len(present)} of {job.nnodes} nodes joined at {address} within "
                f"{job.timeout_s:g}s ({len(present) * job.nproc_per_node} of "
                f"{job.nnodes * job.nproc_per_node} ranks); missing node rank(s): "
                f"{', '.join(map(str, missing))}. Start the same command there with "
                "--node-rank set, or raise --timeout"
            )
        time.sleep(0.2)


def wait_for_port(job: WorkerJob) -> None:
    """Poll the master's port from Python: TCPStore's own retries print C++ stack traces."""
    import time

    deadline = time.monotonic() + job.timeout_s
    while True:
        try:
            socket.create_connection((job.master_addr, job.master_port), timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise runtime_error(
                    f"node {job.node_rank}: could not reach the master at {job.master_addr}:"
                    f"{job.master_port} within {job.timeout_s:g}s; start node 0 first, check "
                    "the address and that the port is open (ddpcli check-env --master-addr "
                    "HOST --master-port PORT)"
                ) from None
            time.sleep(0.5)


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else type(error).__name__


def _launch_elastic(cfg: TrainConfig, debug: bool) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    request = out / ".launch-config.json"
    request.write_text(cfg.model_dump_json())
    summary_file = out / "summary.json"
    summary_file.unlink(missing_ok=True)
    job = WorkerJob(
        module=WORKER_MODULE,
        args=[str(request)],
        nproc_per_node=cfg.nproc_per_node,
        nnodes=cfg.nnodes,
        node_rank=cfg.node_rank,
        master_addr=cfg.master_addr,
        master_port=cfg.master_port,
        timeout_s=cfg.timeout,
        max_restarts=cfg.max_restarts,
        env=worker_environment(cfg),
        log_dir=str(cfg.log_dir) if cfg.log_dir else None,
    )
    try:
        run_workers(job, debug)
    finally:
        request.unlink(missing_ok=True)
    if summary_file.exists():
        return json.loads(summary_file.read_text())
    return {"out": str(out), "node_rank": cfg.node_rank}  # rank 0 runs on another node


def describe_failure(failure) -> DdpcliError:
    """Name the first rank that failed, how it ended, and the last lines it printed."""
    rank, first = failure.get_first_failure()
    how = exit_in_words(first.exitcode)
    lines = [f"rank {rank} on {socket.gethostname()} failed first: {how}"]
    detail = error_tail(first)
    if detail:
        lines.append(detail)
    others = sorted(r for r in failure.failures if r != rank)
    if others:
        lines[0] += f" (then ranks {', '.join(map(str, others))} stopped)"
    code = USAGE if first.exitcode == USAGE else 1
    return usage_error("\n".join(lines)) if code == USAGE else runtime_error("\n".join(lines))


def exit_in_words(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (most likely out of memory, or the scheduler)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}"
    return f"exit code {exitcode}"


def error_tail(failure, lines: int = 3) -> str:
    """The end of the worker's recorded traceback, if it left one."""
    message = failure.message if isinstance(failure.message, str) else ""
    if isinstance(failure.error_file_data, dict):
        message = failure.error_file_data.get("message", {})
        if isinstance(message, dict):
            extra = message.get("extraInfo", {}).get("py_callstack", "")
            message = extra or message.get("message", "")
    tail = [line for line in str(message).strip().splitlines() if line.strip()][-lines:]
    if not tail or tail[-1] == "<NONE>" or "To enable traceback" in tail[-1]:
        return ""
    if tail[-1].startswith("Signal "):
        return ""
    return "\n".join(f"  {line}" for line in tail)
