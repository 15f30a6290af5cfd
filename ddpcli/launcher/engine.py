"""The engine every command starts its workers on (`train`, `eval`, `bench-barrier`,
`launch`): a WorkerJob run through torch.distributed.elastic (the engine behind torchrun),
which brings rendezvous, restarts and per-rank error reports; the workers' environment;
the roll call that gathers a static job's nodes first; a failed or stopped job in words.
Each command's own launch builds its WorkerJob beside this module (`train_launch`,
`script_launch`) or in its package (`ddpcli.evaluation.launch`, `ddpcli.barrier.run`).
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
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpcli.collectives.gather import judged, keep_records, post_records
from ddpcli.collectives.record import RECORD_PREFIX, RECORDS_FOLDER_VARIABLE, recorder_environment
from ddpcli.config import ScriptLaunchConfig, TrainConfig
from ddpcli.config.eval import EvalConfig
from ddpcli.environments import LauncherEnv
from ddpcli.environments.world import DEFAULT_MASTER_PORT
from ddpcli.errors import (
    INTERRUPTED,
    RUNTIME,
    USAGE,
    DdpcliError,
    first_line,
    runtime_error,
    usage_error,
)
from ddpcli.launcher.failure_report import describe_failure, ending_in_words, failed_of_itself
from ddpcli.launcher.fork import (
    fork_server,
    forks_workers,
    function_path_fixed,
    start_forked_worker,
)
from ddpcli.launcher.membership import advertised_address, c10d_settings
from ddpcli.launcher.peer_failure import failed_workers_handled
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
from ddpcli.launcher.store_address import check_endpoint, check_served_here
from ddpcli.machine import cpu_count
from ddpcli.process import PARENT_PID_VARIABLE
from ddpcli.stacks import STACKS_FOLDER_VARIABLE

if TYPE_CHECKING:  # torch is imported where a launch needs it, not with this module
    from torch.distributed import Store
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig


def early_fork_server(
    module: str, uses_gpus: bool, launcher: LauncherEnv | None
) -> contextlib.AbstractContextManager[Any]:
    """For a command whose launch will fork its workers (CPU ranks, no outside launcher):
    the fork server of MODULE, started once the flags are checked and before this process
    uses torch, so that it shares this process's torch import and imports the worker while
    the launcher forms the job. It stops when the command ends."""
    if launcher is not None or not forks_workers(uses_gpus):  # as the job decides
        return contextlib.nullcontext()
    return fork_server(module)


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


# Elastic lends its workers one store for every round of its rendezvous, and where rounds
# follow each other it fails them: restarted Gloo ranks read the last round's addresses
# under the same keys and fail to connect or hang (pytorch#135712; torchrun too), an agent
# that restarts for a membership change counts no restart, so a per-restart prefix can
# differ between hosts, and a host that joins a running job waits for good for an address
# the first host published only in the first round. This opts out: every round's rank 0
# worker hosts a store of its own, at an address the rendezvous hands out anew.
STORE_PER_ROUND = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


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
    # torch's flight recorder on in every worker (--no-flight-recorder: off); their records,
    # when the job stops because ranks no longer agree, kept in RECORDS_KEPT_IN (a run's
    # collectives/ folder) for the verdict (ddpcli.collectives).
    flight_recorder: bool = False
    records_kept_in: Path | None = None

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
        # The host filled in here: torch fills its own ${hostname} only from torch 2.14.
        prefix = f"[{socket.gethostname()} rank ${{rank}}] "
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
        # Started first: the server imports the worker while this process forms the job.
        server = stack.enter_context(fork_server(job.module)) if job.fork else None
        # Elastic hosts have no node rank to answer a roll call by: the rendezvous bounds them.
        static_nodes = job.nnodes > 1 and job.rendezvous is None
        # Node 0 hosts it (kept alive here), and the others post their records to it.
        store = roll_call(job) if static_nodes else None
        if job.rendezvous is not None:
            check_endpoint(*job.rendezvous, job.timeout_s)
        elif job.nnodes == 1 and job.master_port is not None:
            check_served_here(job.master_addr, job.agent_port)
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="ddpcli-agent-"))
        stacks = stacks_folder(job, Path(scratch))
        job = with_flight_recorder(job, Path(scratch))
        start_workers(job, launch_config(job, scratch), server, stacks, store)


def with_flight_recorder(job: WorkerJob, scratch: Path) -> WorkerJob:
    """JOB with the variables that turn each worker's flight recorder on (or off), and name
    the folder where a worker leaves its record when the job stops."""
    records = scratch / "records" if job.flight_recorder else None
    if records is not None:
        records.mkdir()
    variables = recorder_environment(job.flight_recorder, records)
    os.environ.update(variables)  # workers started as programs inherit them
    return replace(job, env={**job.env, **variables})


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
    job: WorkerJob,
    config: LaunchConfig,
    fork_server_pid: str | None,
    stacks: Path | None = None,
    store: Store | None = None,
) -> None:
    """Run the job's workers, forked from the fork server FORK_SERVER_PID or started as
    new interpreters; a failure to start or finish becomes a DdpcliError (which says where
    stopped workers were, from the stacks they left in STACKS, and where the ranks'
    collectives parted, from the records that reach node 0, some on the nodes' STORE)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    records = records_folder(job)
    with contextlib.ExitStack() as patches:
        patches.enter_context(keep_alive_timers_stopped())
        patches.enter_context(failed_workers_handled(job.peer_failed_notice, records))
        attempts = patches.enter_context(restarts_announced(job.max_restarts, job.nproc_per_node))
        try:
            if fork_server_pid is not None:
                with function_path_fixed():
                    entry = elastic_launch(config, start_forked_worker)
                    entry(fork_server_pid, job.env, job.module, *job.args)
            else:
                elastic_launch(config, sys.executable)("-m", job.module, *job.args)
        except ChildFailedError as failure:
            in_words = failure_in_words(job, failure, stacks, attempts.made)
            raise with_verdict(in_words, job, failure, records, stacks, store) from None
        except SignalException as received:
            raise JobStopped(received.sigval) from None
        except Exception as error:  # rendezvous errors: the world never formed
            described = never_formed(job, error)
            if described is None:
                raise
            raise described from error


@contextlib.contextmanager
def keep_alive_timers_stopped() -> Iterator[None]:
    """Elastic's rendezvous keeps itself alive with a timer thread (a heartbeat to its store
    every few seconds). An agent stopped by a signal leaves its rendezvous open, for the other
    nodes, and its timer running: torch never stops one at exit, and a heartbeat that returns
    from C++ while the interpreter shuts down ends its thread there ("terminate called without
    an active exception", SIGABRT after the launcher's last line: 1 in 40 Ctrl-Cs under load).
    Every timer started meanwhile is stopped when the block ends, its heartbeat given a bounded
    while to finish. Its finalizer, which the cyclic collector can run in the timer's own
    thread ("cannot join current thread", 2 in 40), skips that join."""
    from torch.distributed.elastic.rendezvous import utils

    def stop_thread(thread: threading.Thread, stop_event: threading.Event) -> None:
        stop_event.set()
        if thread is not threading.current_thread():
            thread.join()

    timer = utils._PeriodicTimer
    originals = {name: timer.__dict__[name] for name in ("start", "_stop_thread")}
    started: list[utils._PeriodicTimer] = []

    def start(self: utils._PeriodicTimer) -> None:
        originals["start"](self)
        started.append(self)

    timer.start = start  # type: ignore[method-assign]
    timer._stop_thread = staticmethod(stop_thread)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(timer, name, original)
        for each in started:
            each._ctx.stop_event.set()
        for each in started:
            if each._thread is not None:  # a heartbeat to a store that no longer answers
                each._thread.join(timeout=KEEP_ALIVE_STOP_S)  # has its own timeout


# How long a keep-alive timer's last heartbeat may take to finish once the launch is over.
KEEP_ALIVE_STOP_S = 2.0


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


def records_folder(job: WorkerJob) -> Path | None:
    """Where this node's workers leave their flight records (with_flight_recorder's)."""
    folder = job.env.get(RECORDS_FOLDER_VARIABLE)
    return Path(folder) if folder else None


def with_verdict(
    described: DdpcliError,
    job: WorkerJob,
    failure: ChildFailedError,
    records: Path | None,
    stacks: Path | None,
    store: Store | None = None,
) -> DdpcliError:
    """Where the ranks' collectives parted and why, when their records (kept in the run's
    collectives/ folder) show it; else DESCRIBED. Node 0 judges, from every node's records
    that reach it (on STORE, the nodes' roll call's, or a shared --out); the others send
    theirs."""
    if records is None or job.records_kept_in is None:
        return described
    if described.exit_code == USAGE or failed_of_itself(failure.failures):
        return described  # the rank's own error, quoted, is the news
    kept = job.records_kept_in
    kept_here = keep_records(records, kept)
    judge_here = job.nnodes == 1 or (job.node_rank == 0 and job.rendezvous is None)
    if kept_here and not judge_here and store is not None:
        return with_records_sent(described, job, store, kept_here)
    if not kept_here or not judge_here:
        return described
    world_size = job.nproc_per_node * job.nnodes
    endings = {rank: ending_in_words(ended) for rank, ended in failure.failures.items()}
    try:
        verdict = judged(kept, world_size, endings, stacks, other_nodes=job.nnodes > 1, store=store)
    except Exception as error:  # torch's analyzer, on records it cannot read: the failure stays
        return DdpcliError(
            f"{described.message}\n  no verdict on the ranks' collectives: their records in "
            f"{kept} could not be read ({type(error).__name__}: {first_line(error)})",
            described.exit_code,
        )
    if isinstance(verdict, list):
        unseen = ", ".join(map(str, verdict))
        return DdpcliError(
            f"{described.message}\n  no verdict on the ranks' collectives: the records of "
            f"rank(s) {unseen} (other nodes) did not reach node 0 (see those nodes' output)",
            described.exit_code,
        )
    if verdict is None:
        return described
    said = [
        *verdict.lines(),
        f"records: {kept} (python -m torch.distributed.flight_recorder.fr_trace {kept} "
        f"--prefix {RECORD_PREFIX})",
    ]
    data = {"verdict": {**verdict.to_dict(), "records": str(kept), "lines": said}}
    # A dead or unresponsive rank, which the description names, stays the news: the verdict
    # adds the collective where the others waited for it. Otherwise the verdict replaces the
    # knock-on effects the ranks saw (a timeout, a peer gone).
    if verdict.cause in ("died", "never_reached"):
        head, rest = [described.message], [verdict.waited_line(), said[-1]]
    else:
        head, rest = said[:1], said[1:]
    message = "\n".join([*head, *(f"  {line}" for line in rest)])
    return DdpcliError(message, described.exit_code, data=data)


def with_records_sent(
    described: DdpcliError, job: WorkerJob, store: Store, files: list[Path]
) -> DdpcliError:
    """DESCRIBED, once this node's records (FILES) are posted to node 0 on STORE; with a
    line that says so when they cannot be (node 0 gone or cut off)."""
    failure = post_records(store, files)
    if failure is None:
        return described
    return DdpcliError(
        f"{described.message}\n  node {job.node_rank}: could not send its ranks' flight "
        f"records to node 0 ({failure}); they are in {files[0].parent}",
        described.exit_code,
        data=described.data,
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
    if name in ("DistNetworkError", "DistStoreError") and job.rendezvous is not None:
        host, port = job.rendezvous
        return runtime_error(
            f"lost the c10d rendezvous at {host}:{port} while the hosts were forming the job "
            f"({first_line(error)}); the endpoint's host most likely stopped: see its output"
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


# The roll call names a setting by its flag; these have none of their own.
SETTING_LABELS = {"nproc_per_node": "processes per node (--nproc, or the GPUs listed)"}


def missing_nodes(job: WorkerJob, present: list[int], address: str) -> str:
    missing = [r for r in range(job.nnodes) if r not in present]
    return (
        f"only {len(present)} of {job.nnodes} nodes joined at {address} within "
        f"{job.timeout_s:g}s ({len(present) * job.nproc_per_node} of "
        f"{job.nnodes * job.nproc_per_node} ranks); missing node rank(s): "
        f"{', '.join(map(str, missing))}. Start the same command there with "
        "--node-rank set, or raise --timeout"
    )
