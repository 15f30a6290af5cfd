"""Starting workers: adopt a launcher's environment, or start our own through
torch.distributed.elastic (the engine behind torchrun), which brings rendezvous,
restarts and per-rank error reports.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpcli import ui
from ddpcli.config import BarrierConfig, ScriptLaunchConfig, TrainConfig
from ddpcli.config.data import WITH_CREDENTIALS
from ddpcli.config.eval import EvalConfig
from ddpcli.environments import LauncherEnv, read_launcher_env
from ddpcli.environments.world import DEFAULT_MASTER_PORT
from ddpcli.errors import (
    INTERRUPTED,
    RUNTIME,
    DdpcliError,
    debug_requested,
    first_line,
    runtime_error,
    usage_error,
)
from ddpcli.launcher.failure_report import describe_failure, newest_run_log_dir
from ddpcli.launcher.fork import (
    fork_server,
    forks_workers,
    function_path_fixed,
    start_forked_worker,
)
from ddpcli.launcher.membership import advertised_address, c10d_settings
from ddpcli.launcher.peer_failure import failed_workers_handled
from ddpcli.launcher.resources import capacity_warnings
from ddpcli.launcher.restarts import restarts_announced
from ddpcli.launcher.rollcall import (
    MasterUnreachable,
    NodeZeroGaveUp,
    NotAStore,
    RollCall,
    describe_values,
    disagreements,
    open_store,
)
from ddpcli.machine import cpu_count
from ddpcli.outputs.runfolder import claim_run_folder
from ddpcli.process import PARENT_PID_VARIABLE, freeze_imported_objects
from ddpcli.records import AGREED_STOP_FILE, PEER_FAILED_FILE
from ddpcli.stacks import STACKS_FOLDER_VARIABLE

if TYPE_CHECKING:  # torch is imported where a launch needs it, not with this module
    from torch.distributed import Store
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig

WORKER_MODULE = "ddpcli.training.worker"
BARRIER_WORKER_MODULE = "ddpcli.barrier.worker"


def launch_train(cfg: TrainConfig, debug: bool = False) -> dict[str, Any]:
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
                draw_curves_after_stop(cfg.resolved_out)
            raise
        if draws and summary.get("stopped"):  # Ctrl-C or a preemption, said by the workers
            draw_curves_after_stop(cfg.resolved_out)
        elif draws and (picture := draw_curves(cfg.resolved_out)):
            summary["curves"] = str(picture)
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


def start_training(cfg: TrainConfig, launcher: LauncherEnv | None, debug: bool) -> dict[str, Any]:
    if launcher is None:
        return _launch_elastic(cfg, debug)
    if cfg.gpus and launcher.rank == 0:
        ui.warn("--gpus is ignored under a launcher: each rank uses the GPU of its LOCAL_RANK")
    if cfg.ifname:  # this process is the worker: set them before its group forms
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = cfg.ifname
    if joining := launcher.joining(cfg.timeout, cfg.init_method):  # said before it waits
        ui.info(joining)
    return run_adopted_worker(cfg, launcher, debug)


def run_adopted_worker(cfg: TrainConfig, launcher: LauncherEnv, debug: bool) -> dict[str, Any]:
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


def early_fork_server(
    cfg: TrainConfig | BarrierConfig, launcher: LauncherEnv | None
) -> contextlib.AbstractContextManager[Any]:
    """For a command whose launch will fork its workers (CPU ranks, no outside launcher):
    the fork server, started once the flags are checked, so that it imports torch and the
    worker while the launcher does too and forms the job. It stops when the command ends."""
    if launcher is not None or not forks_workers(cfg.uses_gpus):  # as the job decides
        return contextlib.nullcontext()
    return fork_server(WORKER_MODULE if isinstance(cfg, TrainConfig) else BARRIER_WORKER_MODULE)


def worker_environment(
    gpus: list[int] | None, nproc_per_node: int, ifname: str | None = None
) -> dict[str, str]:
    """Variables every command's workers inherit; set before any of them initialises CUDA."""
    env: dict[str, str] = {}
    if gpus:
        # Physical indices -> the workers see only these, renumbered cuda:0.., cuda:N-1.
        # CUDA's own order puts the fastest GPU first: on a node of mixed GPUs its index 0
        # is not nvidia-smi's GPU 0 unless the order is the PCI bus's.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index) for index in gpus)
    else:
        env["OMP_NUM_THREADS"] = str(max(1, cpu_count() // nproc_per_node))
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = ifname
        env["NCCL_SOCKET_IFNAME"] = ifname
    return env


@dataclass
class WorkerJob:
    """What any command needs to start its local workers under the elastic agent."""

    module: str  # run as `python -m module *args` in every worker
    args: list[str]
    nproc_per_node: int
    # Fork the workers from this process, which imports MODULE once for all of them, instead
    # of starting an interpreter each (ddpcli.launcher.fork). Only for jobs that never use CUDA.
    fork: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None on one node: a free port is picked
    timeout_s: float = 300.0
    max_restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None
    # What every node must agree on ({flag: value as text}), compared at the roll call.
    settings: dict[str, str] = field(default_factory=dict)
    # `ddpcli train`'s --timeout also bounds every collective; a user's script sets its own.
    timeout_bounds_collectives: bool = True
    # Elastic membership: the c10d rendezvous's endpoint (None: static, by --node-rank), the
    # fewest nodes it starts with (None: exactly nnodes), the job's name, this host's NIC.
    rendezvous: tuple[str, int] | None = None
    min_nnodes: int | None = None
    rdzv_id: str | None = None
    ifname: str | None = None
    # Touched by the agent before it stops the workers after one failed, for workers that
    # take SIGTERM as a preemption (ddpcli.launcher.peer_failure); None: their SIGTERM ends them.
    peer_failed_notice: Path | None = None
    # Workers that write their stack to a file when stopped (ddpcli.launcher.bootstrap), for the
    # report to say where they were; else they print it.
    stacks_to_report: bool = False
    # The same, in a folder the workers know without being told (ddpcli.training.worker's:
    # the one of its config).
    stacks_dir: Path | None = None
    # torchrun's flags as `ddpcli launch` takes them: which output goes to --log-dir's files
    # (None: all of it) and which the terminal also shows (None: rank 0's, every error),
    # the local ranks the terminal shows (None: all), the rendezvous's own settings, the
    # agent's role name, how often it looks at its workers, this host's advertised address.
    redirects: str | None = None
    tee: str | None = None
    local_ranks_filter: list[int] | None = None
    rdzv_settings: dict[str, Any] = field(default_factory=dict)
    role: str | None = None
    monitor_interval: float = 0.1
    local_addr: str | None = None

    @property
    def agent_port(self) -> int:
        """Where node 0's agent listens when the job's agents meet on the master's address:
        --master-port, else torchrun's default."""
        return self.master_port or DEFAULT_MASTER_PORT


def job_membership(cfg: TrainConfig | ScriptLaunchConfig | EvalConfig) -> dict[str, Any]:
    """The WorkerJob fields that say how this node meets the others, as `train`, `launch`
    and `eval` all give them."""
    master_addr, master_port = cfg.master_addr, cfg.master_port
    if cfg.rdzv_endpoint:  # --rdzv-endpoint names node 0's agent of a static job too
        master_addr, master_port = cfg.rendezvous_address(DEFAULT_MASTER_PORT)
    return {
        "nnodes": cfg.nnodes,
        "node_rank": cfg.node_rank,
        "master_addr": master_addr,
        "master_port": master_port,
        "rendezvous": cfg.rendezvous_address(DEFAULT_MASTER_PORT) if cfg.elastic else None,
        "min_nnodes": cfg.min_nnodes,
        "rdzv_id": cfg.rdzv_id,
        "ifname": cfg.ifname,
        "timeout_s": cfg.timeout,
        "max_restarts": cfg.max_restarts,
    }


def launch_config(job: WorkerJob, scratch: str) -> LaunchConfig:
    """The elastic agent's settings; its per-attempt files (error reports, and the workers'
    output when there is no --log-dir) go under SCRATCH, which the launch removes."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    timeout = max(1, int(job.timeout_s))
    local_addr = job.local_addr
    if job.rendezvous is not None:
        host, port = job.rendezvous
        backend, endpoint = "c10d", f"{host}:{port}"
        rdzv_configs = c10d_settings(host, timeout)
        local_addr = local_addr or advertised_address(job.ifname, host)
    elif job.nnodes == 1 and job.master_port is None:
        # Port 0: the rendezvous store binds a free port, so runs on one machine never collide.
        backend, endpoint, rdzv_configs = "c10d", "127.0.0.1:0", {"timeout": timeout}
    else:
        backend, endpoint = "static", f"{job.master_addr}:{job.agent_port}"
        rdzv_configs = {"rank": job.node_rank, "timeout": timeout}
    prefix = None
    shown = set(job.local_ranks_filter) if job.local_ranks_filter is not None else None
    if job.log_dir:
        # Every rank's output in its own file; the console shows rank 0 and everyone's errors.
        tee = {rank: Std.ALL if rank == 0 else Std.ERR for rank in range(job.nproc_per_node)}
        logs = DefaultLogsSpecs(
            log_dir=job.log_dir,
            redirects=Std.from_str(job.redirects) if job.redirects else Std.ALL,
            tee=Std.from_str(job.tee) if job.tee else tee,
            local_ranks_filter=shown,
        )
        prefix = "[${hostname} rank ${rank}] "
    else:
        # Left to itself the agent makes a torchelastic_* folder in the system's temporary
        # directory for every run, and never removes it.
        logs = DefaultLogsSpecs(log_dir=scratch, local_ranks_filter=shown)
    return LaunchConfig(
        min_nodes=job.min_nnodes or job.nnodes,
        max_nodes=job.nnodes,
        nproc_per_node=job.nproc_per_node,
        run_id=job.rdzv_id or (f"ddpcli-{uuid.uuid4().hex[:8]}" if job.nnodes == 1 else "ddpcli"),
        local_addr=local_addr,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs={**rdzv_configs, **job.rdzv_settings},
        role=job.role or "default_role",
        max_restarts=job.max_restarts,
        monitor_interval=job.monitor_interval,
        start_method="forkserver" if job.fork else "spawn",
        logs_specs=logs,
        log_line_prefix_template=prefix,
        # SIGUSR1 too (SLURM's `--signal=USR1@90`): else it would end the agent, not reach them.
        signals_to_handle=",".join(AGENT_SIGNALS),
        # No shutdown_timeout: with a short one (seen on torch 2.14) restarted
        # Gloo workers could not connect to each other again.
    )


class JobStopped(DdpcliError):
    """The launcher got a signal (Ctrl-C, a scheduler's SIGTERM or SIGUSR1): the agent passed
    it on to every worker, gave them its shutdown grace to end, and killed what was left."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        name = signal.Signals(signum).name
        self.signal_words = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"got {name}"
        super().__init__(self.signal_words, INTERRUPTED if signum == signal.SIGINT else RUNTIME)


# The agent passes these on to its workers before it stops them; the rest end it at once.
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")


def run_workers(job: WorkerJob, debug: bool = False) -> None:
    """Start `job` under torch.distributed.elastic and wait; a failed rank becomes a
    DdpcliError naming it (exit 2 if it failed on bad input, 1 otherwise), a signal to the
    launcher a JobStopped once every worker has ended."""
    if not debug:
        quiet_elastic_logs()
    os.environ.update(job.env)  # inherited by the workers, before any of them starts CUDA
    os.environ[PARENT_PID_VARIABLE] = str(os.getpid())  # workers die with us (process.py)
    with contextlib.ExitStack() as stack:
        # Started first: the server imports torch while this process forms the job.
        server = stack.enter_context(fork_server(job.module)) if job.fork else None
        # Elastic hosts have no node rank to answer a roll call by: the rendezvous bounds them.
        static_nodes = job.nnodes > 1 and job.rendezvous is None
        store = roll_call(job) if static_nodes else None  # noqa: F841 - keeps the server alive
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="ddpcli-agent-"))
        stacks = stacks_folder(job, Path(scratch))
        start_workers(job, launch_config(job, scratch), server, stacks)


def stacks_folder(job: WorkerJob, scratch: Path) -> Path | None:
    """Where the workers write their stacks when stopped, named to them by a variable."""
    if job.stacks_dir is not None:
        return job.stacks_dir
    if not job.stacks_to_report:
        return None
    folder = scratch / "stacks"
    folder.mkdir()
    os.environ[STACKS_FOLDER_VARIABLE] = str(folder)
    return folder


def quiet_elastic_logs() -> None:
    """Elastic's lines would come between the workers' and ours, and say less. Its loggers
    are made as its modules are imported, some with a level of their own (WARNING: "Received
    15 death signal, shutting down workers" after a preemption), which a parent's level does
    not override: each is quieted, once the launch's modules are in."""
    import torch.distributed.launcher.api  # noqa: F401 - makes the agent's loggers

    for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def start_workers(
    job: WorkerJob, config: LaunchConfig, fork_server_pid: str | None, stacks: Path | None = None
) -> None:
    """Run the job's workers, forked from the fork server FORK_SERVER_PID or started as
    new interpreters; a failure to start or finish becomes a DdpcliError (which says where
    stopped workers were, from the stacks they left in STACKS)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    with contextlib.ExitStack() as patches:
        patches.enter_context(failed_workers_handled(job.peer_failed_notice))
        attempts = patches.enter_context(restarts_announced(job.max_restarts, job.nproc_per_node))
        try:
            if fork_server_pid is not None:
                with function_path_fixed():
                    entry = elastic_launch(config, start_forked_worker)
                    entry(fork_server_pid, job.env, job.module, *job.args)
            else:
                elastic_launch(config, sys.executable)("-m", job.module, *job.args)
        except ChildFailedError as failure:
            raise failure_in_words(job, failure, stacks, attempts.made) from None
        except SignalException as received:
            raise JobStopped(received.sigval) from None
        except Exception as error:  # rendezvous errors: the world never formed
            described = never_formed(job, error)
            if described is None:
                raise
            raise described from error


def failure_in_words(
    job: WorkerJob, failure: ChildFailedError, stacks: Path | None, attempts: int
) -> DdpcliError:
    collective_timeout = job.timeout_s if job.timeout_bounds_collectives else None
    # Static on one node: every rank of the job is one of this node's workers.
    one_node = job.nnodes == 1 and job.min_nnodes is None
    world_size = job.nproc_per_node if one_node else None
    return describe_failure(
        failure, job.log_dir, collective_timeout, stacks, world_size, attempts=attempts
    )


def never_formed(job: WorkerJob, error: Exception) -> DdpcliError | None:
    """The rendezvous's errors, which end a launch before its workers ran, in words; None
    for any other error."""
    name = type(error).__name__
    if job.rendezvous is not None and ("Rendezvous" in name or "Timeout" in name):
        host, port = job.rendezvous
        return runtime_error(
            f"the job never formed: {name} after {job.timeout_s:g}s waiting for "
            f"{job.min_nnodes or job.nnodes} to {job.nnodes} host(s) at the c10d rendezvous "
            f"{host}:{port} ({first_line(error)}); start the same command on enough hosts, "
            "check that the endpoint's host runs it too, or raise --timeout"
        )
    if "Rendezvous" in name or "Timeout" in name:
        return runtime_error(
            f"the job never formed: {name} after {job.timeout_s:g}s waiting for "
            f"{job.nnodes} node(s) at {job.master_addr}:{job.master_port}; start the same "
            "command on every node (only --node-rank differs) or raise --timeout"
        )
    if name in ("DistNetworkError", "DistStoreError") and job.nnodes > 1:
        # Node 0's agent hosts the store: it stopped (a node missing at its roll call,
        # killed) while this node's agent was still forming the job with it.
        return runtime_error(
            f"node {job.node_rank}: lost the master at {job.master_addr}:{job.master_port} "
            f"while the nodes were forming the job ({first_line(error)}); node 0 most "
            "likely stopped: see its output"
        )
    return None


ROLL_PREFIX = "ddpcli/roll/"


def roll_call(job: WorkerJob) -> Store:
    """Before any worker starts, every node reports to node 0 on the master's store, so a
    node that never comes is named after --timeout instead of everyone waiting forever.
    Node 0 hosts the store (multi-tenant: the elastic agent's rendezvous reuses it), and
    when it gives up it posts why, so the nodes that came say the same
    (ddpcli.launcher.rollcall)."""
    address = f"{job.master_addr}:{job.agent_port}"
    try:
        store = open_store(
            job.master_addr, job.agent_port, job.node_rank, job.timeout_s, multi_tenant=True
        )
    except NotAStore as service:
        raise runtime_error(
            f"node {job.node_rank}: a non-PyTorch service answers at {address}, not node 0's "
            f"store ({service}); give every node the same free --master-port, and check that "
            "--master-addr is node 0's"
        ) from None
    except MasterUnreachable:
        raise runtime_error(
            f"node {job.node_rank}: could not reach the master at {address} within "
            f"{job.timeout_s:g}s; start node 0 first, check the address and that the port is "
            "open (ddpcli check-env --master-addr HOST --master-port PORT)"
        ) from None
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
    roll = RollCall(store, ROLL_PREFIX, job.nnodes, job.node_rank)
    try:
        roll.answer(json.dumps({"host": socket.gethostname(), "settings": job.settings}))
        # The others joined after node 0 started waiting: its verdict comes before their deadline.
        present = roll.wait(job.timeout_s + (0 if job.node_rank == 0 else 30))
        if len(present) < job.nnodes:
            verdict = missing_nodes(job, present, address)
            if job.node_rank == 0:
                roll.post_verdict(verdict, present)
            raise runtime_error(verdict)
        check_same_settings(roll, job.node_rank)
    except NodeZeroGaveUp as verdict:
        raise runtime_error(f"node {job.node_rank}: node 0 gave up: {verdict}") from None
    except RuntimeError as error:  # DistNetworkError: node 0 went away without a word
        raise runtime_error(
            f"node {job.node_rank}: lost the master at {address} before all nodes joined "
            f"({first_line(error)}); node 0 most likely stopped: see its output"
        ) from None
    return store


def check_same_settings(roll: RollCall, node_rank: int) -> None:
    """Every node has answered with its settings: every node compares them all and, when
    they differ, stops within seconds naming each one (node 0 after the others have read
    the answers, since it closes the store). Left alone, such nodes wait out --timeout in
    a rendezvous or a collective that never completes, and blame the network."""
    answers = {rank: json.loads(text) for rank, text in roll.answers().items()}
    differing = disagreements(
        {f"node {rank} ({answer['host']})": answer["settings"] for rank, answer in answers.items()}
    )
    if not differing:
        return
    lines = [
        f"  {SETTING_LABELS.get(name, '--' + name.replace('_', '-'))}: {describe_values(values)}"
        for name, values in differing.items()
    ]
    verdict = "\n".join(
        [
            "the nodes were started with different settings:",
            *lines,
            "start the same command on every node: only --node-rank, and each node's own paths, "
            "GPUs, interface and --timeout, may differ",
        ]
    )
    if node_rank == 0:
        roll.post_verdict(verdict, list(answers))
    else:
        roll.acknowledge()
    raise runtime_error(verdict)


# Settings each node may give its own way: its files, its devices and network interface,
# how it reaches node 0, how long it waits. Everything else in the resolved configuration
# changes the job (its world, its arithmetic, when its ranks meet) and must agree.
PER_NODE_SETTINGS = frozenset({
    "node_rank", "gpus", "data_dir", "data_path", "workers", "download", "out", "resume",
    "log_dir", "trace_samples", "ifname", "master_addr", "master_port", "init_method", "timeout",
    "world_from", "precision_reason", "slow_data", "resume_checked",
})  # fmt: skip
SETTING_LABELS = {"nproc_per_node": "processes per node (--nproc, or the GPUs listed)"}


def settings_every_node_shares(cfg: TrainConfig) -> dict[str, str]:
    document = cfg.model_dump(mode="json")
    document["nproc_per_node"] = cfg.nproc_per_node
    return {
        name: value if isinstance(value, str) else "unset" if value is None else json.dumps(value)
        for name, value in document.items()
        if name not in PER_NODE_SETTINGS
    }


def missing_nodes(job: WorkerJob, present: list[int], address: str) -> str:
    missing = [r for r in range(job.nnodes) if r not in present]
    return (
        f"only {len(present)} of {job.nnodes} nodes joined at {address} within "
        f"{job.timeout_s:g}s ({len(present) * job.nproc_per_node} of "
        f"{job.nnodes * job.nproc_per_node} ranks); missing node rank(s): "
        f"{', '.join(map(str, missing))}. Start the same command there with "
        "--node-rank set, or raise --timeout"
    )


def _launch_elastic(cfg: TrainConfig, debug: bool) -> dict[str, Any]:
    out = cfg.resolved_out
    for warning in capacity_warnings(cfg):
        ui.warn(warning)
    summary_file = out / "summary.json"  # rank 0 writes it, and rank 0 runs on node 0
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
        except DdpcliError:  # a failed rank (a JobStopped is caught above)
            agreed = read_agreed_stop(Path(private) / AGREED_STOP_FILE)
            if agreed is None:
                raise
            raise DdpcliError(agreed["failed"], agreed["exit_code"]) from None
    if job.log_dir:
        ui.info(f"per-rank logs: {newest_run_log_dir(job.log_dir)}/attempt_N/<local rank>/")
    if cfg.node_rank == 0 and summary_file.exists():
        return json.loads(summary_file.read_text())
    return {"out": str(out), "node_rank": cfg.node_rank}


def read_stop_record(summary_file: Path) -> dict[str, Any] | None:
    """Rank 0's summary when the run stopped early (Ctrl-C, a preemption), else None."""
    record = read_rank0_record(summary_file)
    return record if record is not None and record.get("stopped") else None


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


def train_environment(cfg: TrainConfig) -> dict[str, str]:
    gpus = cfg.gpus if cfg.uses_gpus else None
    env = worker_environment(gpus, cfg.nproc_per_node, cfg.ifname)
    # Restarts on a fixed membership keep the lent store: the workers key each attempt apart
    # (ddpcli.dist), which holds as long as every agent counts the same restarts.
    return {**env, **STORE_PER_ROUND} if cfg.elastic else env


# Elastic lends its workers one store for every round of its rendezvous, and where rounds
# follow each other it fails them: restarted Gloo ranks read the last round's addresses
# under the same keys and fail to connect or hang (pytorch#135712; torchrun too), an agent
# that restarts for a membership change counts no restart, so a per-restart prefix can
# differ between hosts, and a host that joins a running job waits for good for an address
# the first host published only in the first round. This opts out: every round's rank 0
# worker hosts a store of its own, at an address the rendezvous hands out anew.
STORE_PER_ROUND = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
