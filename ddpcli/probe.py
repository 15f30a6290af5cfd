"""`ddpcli check-env --probe`: a real collective among this node's processes and, with
--nnodes, across nodes, in stages that each have a short deadline, so the probe never hangs.

The parent (check-env on each node) plays the part of torchrun's agent: node 0's parent hosts
the rendezvous store on the master port and every node's parent joins it, so a node that never
comes is named. Each parent then starts its local workers (`python -m ddpcli.probe REQUEST`),
which join the process group through that store with `ddpcli.dist.init_distributed`, run the
stages, and append each stage's outcome to their own log file as it ends. The parents watch
those files against each stage's deadline, stop whatever overruns, and swap their ranks'
outcomes through the store so that every node reports every rank.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpcli.envcheck import (
    FAIL,
    PROBE_TAG_VARIABLE,
    WARN,
    CheckEnvOptions,
    Master,
    NodeFacts,
    Row,
    address_for,
    comparable_settings,
    fail,
    free_port,
    ok,
    port_holder,
    software_versions,
    try_connect,
)
from ddpcli.errors import first_line

STAGES = ("start", "init", "all_reduce", "facts", "barrier", "bandwidth", "p2p")
STAGE_TITLES = {
    "start": "worker start",
    "init": "process group",
    "all_reduce": "all_reduce result",
    "facts": "rank facts",
    "barrier": "barrier latency",
    "bandwidth": "all_reduce bandwidth",
    "p2p": "GPU peer-to-peer",
}
STAGE_FIXES = {
    "start": "the worker could not start: its last lines are above; the same Python environment "
    "must exist on every node",
    "init": "every rank must reach the store and then every other rank: start the probe on all "
    "nodes at once, name the interface the nodes share (--ifname) and open the ports between "
    "them (docs/troubleshooting.md)",
    "all_reduce": "the network or backend corrupts data: isolate the transport with "
    "NCCL_P2P_DISABLE=1 / NCCL_IB_DISABLE=1, and check that every node has the same MTU",
    "facts": "a rank dropped out of the group: see the rank rows below",
    "barrier": "a rank dropped out of the group: see the rank rows below",
    "bandwidth": "a large message did not get through in time: a slow or lossy link (MTU "
    "mismatch?); retry with a larger --stage-timeout to measure it",
    "p2p": "export NCCL_P2P_DISABLE=1 (slower, through host memory); check `nvidia-smi topo -m` "
    "and turn off PCIe ACS / the IOMMU for GPU peer access",
}
START_BUDGET_S = 60.0  # importing torch on a loaded machine
PARENT_GRACE_S = 5.0  # beyond a stage's budget, before the parent stops a silent worker
FAILED_PEER_GRACE_S = 3.0  # after a rank fails, time for the others to log their own failure
KILL_GRACE_S = 3.0
POLL_S = 0.1
CPU_MESSAGE_BYTES = 16 * 2**20
GPU_MESSAGE_BYTES = 256 * 2**20
P2P_MESSAGE_BYTES = 4 * 2**20
BARRIER_ITERATIONS = 20
BANDWIDTH_ITERATIONS = 3
FACTS_FILE = "facts.json"
REQUEST_FILE = "request.json"


# --- The plan ------------------------------------------------------------------------------------


@dataclass
class ProbePlan:
    backend: str  # gloo | nccl, resolved
    nproc: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None  # None: a one-node probe lets the store pick a free port
    ifname: str | None
    join_timeout: float
    stage_timeout: float

    @property
    def use_gpus(self) -> bool:
        return self.backend == "nccl"

    @property
    def hosts_store(self) -> bool:
        return self.node_rank == 0

    def budgets(self, largest_node: int) -> dict[str, float]:
        pairs = largest_node * (largest_node - 1) // 2
        step = self.stage_timeout
        return {
            "start": START_BUDGET_S,
            "init": step + 5,  # the processes of other nodes start a little later
            "all_reduce": step,
            "facts": step,
            "barrier": step,
            "bandwidth": 2 * step,
            "p2p": step + 2 * pairs,
        }


def plan_probe(options: CheckEnvOptions, facts: NodeFacts, master: Master) -> ProbePlan | Row:
    """The probe to run, or the row that says why it cannot run here."""
    backend = choose_backend(options, facts)
    if isinstance(backend, Row):
        return backend
    nproc = options.nproc or (facts.visible_gpus if backend == "nccl" else 2)
    if options.multi_node:
        if master.ip is None:
            return fail("probe", f"{master.addr} does not resolve", "give node 0's IP address")
        address, port = master.ip, options.master_port
    else:
        # One node: the store lives here; use the master address only if it is ours.
        address = master.ip if master.this_node and master.ip else "127.0.0.1"
        port = options.master_port if options.port_given else None
    return ProbePlan(
        backend=backend,
        nproc=nproc,
        nnodes=options.nnodes,
        node_rank=options.node_rank,
        master_addr=address,
        master_port=port,
        ifname=options.ifname,
        join_timeout=options.timeout,
        stage_timeout=options.stage_timeout,
    )


def choose_backend(options: CheckEnvOptions, facts: NodeFacts) -> str | Row:
    gpus, available = facts.visible_gpus, facts.backends
    if options.backend == "nccl":
        if gpus == 0 or not available["nccl"]:
            return fail(
                "probe",
                "--backend nccl needs GPUs and an NCCL build of torch; this node has "
                f"{gpus} visible GPU(s)",
                "use --backend gloo (or auto) on the CPU",
            )
        return "nccl"
    if options.backend == "auto" and gpus > 0 and available["nccl"]:
        return "nccl"
    if not available["gloo"]:
        return fail("probe", "Gloo is not in this torch build", "install an official torch wheel")
    return "gloo"


# --- The parent: store, nodes, workers, outcomes ----------------------------------------------


def run_probe(
    options: CheckEnvOptions,
    facts: NodeFacts,
    master: Master,
    progress: Callable[[str], None],
) -> tuple[list[Row], dict]:
    plan = plan_probe(options, facts, master)
    if isinstance(plan, Row):
        return [plan], {"ran": False, "reason": plan.detail}
    store, port, port_row = open_store(plan, progress)
    if store is None:
        return [port_row], {"ran": False, "reason": port_row.detail}
    return probe_with_store(store, port, plan, facts, progress, port_row)


def probe_with_store(store, port: int, plan: ProbePlan, facts: NodeFacts, progress, port_row: Row):
    record = node_record(facts, plan)
    try:
        nodes, nodes_row = join_nodes(store, plan, record)
    except Exception as error:  # node 0 went away while the nodes gathered
        detail = f"lost node 0's store: {first_line(error)}"
        nodes, nodes_row = None, fail("store rendezvous", detail, STAGE_FIXES["init"])
    rows = [port_row, nodes_row]
    document: dict[str, Any] = {
        "ran": True,
        "backend": plan.backend,
        "master": f"{plan.master_addr}:{port}",
        "nodes": nodes or [record],
    }
    if nodes is None:
        return rows, document
    layout = RankLayout([node["nproc"] for node in nodes])
    with tempfile.TemporaryDirectory(prefix="ddpcli-probe-") as workdir:
        local = run_local_ranks(plan, port, layout, nodes, Path(workdir), progress)
        gathered = read_json(Path(workdir) / FACTS_FILE)
    outcomes = exchange_outcomes(store, plan, layout, nodes, local)
    rows += stage_rows(outcomes) + rank_rows(outcomes)
    compared = gathered if isinstance(gathered, list) else nodes
    rows += consistency_rows(compared, nodes)
    document.update(
        world_size=layout.world_size,
        ranks=outcomes,
        facts=gathered,
        mismatches=[row.name for row in rows if row.name.startswith("mismatch")],
    )
    return rows, document


def open_store(plan: ProbePlan, progress) -> tuple[Any, int, Row]:
    """Node 0 listens on the master port; the others connect to it (the 'port open' stage)."""
    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=plan.join_timeout)
    if plan.hosts_store:
        port = plan.master_port or 0
        try:
            store = TCPStore(
                plan.master_addr, port, is_master=True, wait_for_workers=False, timeout=timeout
            )
        except Exception as error:
            return None, port, busy_port_row(port, error)
        return store, store.port, ok("port open", f"the store listens on port {store.port}")
    target = f"{plan.master_addr}:{plan.master_port}"
    progress(f"probe: waiting up to {plan.join_timeout:g}s for node 0's store at {target}")
    started = time.monotonic()
    try:
        wait_until_listening(plan.master_addr, plan.master_port, plan.join_timeout)
        left = max(5.0, plan.join_timeout - (time.monotonic() - started))
        store = TCPStore(
            plan.master_addr, plan.master_port, timeout=datetime.timedelta(seconds=left)
        )
    except Exception as error:
        row = fail(
            "port open",
            f"could not reach node 0 at {target} within {plan.join_timeout:g}s: "
            f"{first_line(error)}",
            "start the probe on node 0 (--node-rank 0) too; check --master-addr, the route to "
            f"it and that TCP port {plan.master_port} is open",
        )
        return None, plan.master_port, row
    elapsed = time.monotonic() - started
    return store, plan.master_port, ok("port open", f"reached {target} after {elapsed:.1f}s")


def wait_until_listening(host: str, port: int, timeout_s: float) -> None:
    """Poll the master port ourselves: the store client's own retries overrun its timeout."""
    deadline = time.monotonic() + timeout_s
    while (result := try_connect(host, port)) != "open":
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens there ({result})")
        time.sleep(0.5)


def busy_port_row(port: int, error: Exception) -> Row:
    holder = port_holder(port) if port else None
    held = f", held by {holder}" if holder else ""
    return fail(
        "port open",
        f"the store cannot listen on port {port}{held}: {first_line(error)}",
        f"pick a free port (--master-port {free_port()}) or stop the process that holds it",
    )


def node_record(facts: NodeFacts, plan: ProbePlan) -> dict:
    names = sorted({gpu.name for gpu in facts.gpus if gpu.cuda_index is not None})
    return {
        "node_rank": plan.node_rank,
        "host": facts.host,
        "address": address_for(plan.ifname, plan.master_addr) or "",
        "nproc": plan.nproc,
        "nnodes": plan.nnodes,
        "pid": os.getpid(),
        "gpu": ", ".join(names) if plan.use_gpus else "cpu",
        **comparable_facts(facts.versions),
    }


def comparable_facts(versions: dict[str, str]) -> dict:
    keys = ("python", "torch", "cuda", "cudnn", "nccl")
    return {
        **{key: versions.get(key, "") for key in keys},
        "tag": os.environ.get(PROBE_TAG_VARIABLE, ""),
        "settings": comparable_settings(),
    }


def join_nodes(store, plan: ProbePlan, record: dict) -> tuple[list[dict] | None, Row]:
    """Every node registers under its node rank; wait for all of them or name who is missing."""
    key = node_key(plan.node_rank)
    mine = json.dumps(record)
    taken = store.compare_set(key, "", mine).decode()
    if taken != mine:
        other = json.loads(taken)
        return None, fail(
            "store rendezvous",
            f"node rank {plan.node_rank} is already taken by {other['host']} ({other['address']})",
            "give every node its own --node-rank, 0..N-1",
        )
    keys = [node_key(rank) for rank in range(plan.nnodes)]
    everyone = wait_for_keys(store, keys, plan.join_timeout)
    present = [json.loads(store.get(k)) for k in keys if store.check([k])]
    disagreeing = [node for node in present if node["nnodes"] != plan.nnodes]
    if disagreeing:
        return None, nnodes_disagreement_row(plan, disagreeing)
    if not everyone:
        return None, missing_nodes_row(plan, present)
    joined = ", ".join(f"{node_label(node)} × {node['nproc']}" for node in present)
    return present, ok("store rendezvous", f"{plan.nnodes} node(s) joined: {joined}")


def missing_nodes_row(plan: ProbePlan, present: list[dict]) -> Row:
    here = {node["node_rank"] for node in present}
    missing = [str(rank) for rank in range(plan.nnodes) if rank not in here]
    came = ", ".join(node_label(node) for node in present)
    hint = ""
    if "0" in missing and not plan.hosts_store:
        hint = " (something listens on the master port, but not node 0's probe: another job?)"
    return fail(
        "store rendezvous",
        f"the world never formed: node(s) {', '.join(missing)} of {plan.nnodes} did not join "
        f"within {plan.join_timeout:g}s{hint}; joined: {came}",
        "run the same command on every node with only --node-rank differing (0.."
        f"{plan.nnodes - 1}), and check --nnodes; raise --timeout if nodes start far apart",
    )


def nnodes_disagreement_row(plan: ProbePlan, disagreeing: list[dict]) -> Row:
    said = ", ".join(f"{node_label(node)} says --nnodes {node['nnodes']}" for node in disagreeing)
    return fail(
        "store rendezvous",
        f"the nodes disagree on the world: this node says --nnodes {plan.nnodes}, {said}",
        "run the same command on every node; only --node-rank differs",
    )


def node_key(node_rank: int) -> str:
    return f"probe/node/{node_rank}"


def node_label(node: dict) -> str:
    address = f", {node['address']}" if node.get("address") else ""
    return f"node {node['node_rank']} ({node['host']}{address})"


def wait_for_keys(store, keys: list[str], timeout_s: float) -> bool:
    # Polling, not store.wait(): a Ctrl-C must not sit behind a blocking C++ call.
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@dataclass
class RankLayout:
    """Global ranks by node: node r's ranks follow those of nodes 0..r-1."""

    procs_per_node: list[int]

    @property
    def world_size(self) -> int:
        return sum(self.procs_per_node)

    def ranks_of(self, node_rank: int) -> list[int]:
        start = sum(self.procs_per_node[:node_rank])
        return list(range(start, start + self.procs_per_node[node_rank]))


@dataclass
class LocalRank:
    rank: int
    local_rank: int
    process: subprocess.Popen
    log_file: Path
    stage_file: Path
    spawned_at: float = field(default_factory=time.time)
    stopped_late: bool = False  # stopped by us for running past a stage's deadline
    stopped: bool = False  # stopped by us after another rank failed


def run_local_ranks(
    plan: ProbePlan, port: int, layout: RankLayout, nodes: list[dict], workdir: Path, progress
) -> list[dict]:
    budgets = plan.budgets(max(layout.procs_per_node))
    request = write_request(plan, layout, budgets, workdir)
    ranks = layout.ranks_of(plan.node_rank)
    progress(f"probe: {len(ranks)} {plan.backend} process(es) here, world size {layout.world_size}")
    workers: list[LocalRank] = []
    try:
        for local_rank, rank in enumerate(ranks):
            workers.append(spawn_worker(plan, port, layout, rank, local_rank, request, workdir))
        watch_workers(workers, budgets)
    finally:
        stop_workers(workers)
    node = nodes[plan.node_rank]
    return [rank_outcome(worker, budgets, node) for worker in workers]


def write_request(plan: ProbePlan, layout: RankLayout, budgets: dict, workdir: Path) -> Path:
    request = {
        "workdir": str(workdir),
        "parent_pid": os.getpid(),
        "backend": plan.backend,
        "use_gpus": plan.use_gpus,
        "stage_timeout": plan.stage_timeout,
        "budgets": budgets,
        "message_bytes": GPU_MESSAGE_BYTES if plan.use_gpus else CPU_MESSAGE_BYTES,
        "node_ranks": [layout.ranks_of(node) for node in range(len(layout.procs_per_node))],
        "master_addr": plan.master_addr,
        "ifname": plan.ifname,
    }
    path = workdir / REQUEST_FILE
    path.write_text(json.dumps(request))
    return path


def spawn_worker(plan, port, layout, rank, local_rank, request: Path, workdir: Path) -> LocalRank:
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(layout.world_size),
        "LOCAL_WORLD_SIZE": str(plan.nproc),
        "GROUP_RANK": str(plan.node_rank),
        "MASTER_ADDR": plan.master_addr,
        "MASTER_PORT": str(port),
        # Our parent hosts the store, as torchrun's agent does: every rank is its client.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if plan.ifname:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = plan.ifname
    log_file = workdir / f"rank-{rank}.log"
    with open(log_file, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "ddpcli.probe", str(request)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as one, never left behind
        )
    return LocalRank(rank, local_rank, process, log_file, workdir / f"rank-{rank}.jsonl")


def watch_workers(workers: list[LocalRank], budgets: dict[str, float]) -> None:
    """Return when every worker ended, one ran past its stage's deadline, or one failed and
    the others had a moment to record their own view of it."""
    first_failure: float | None = None
    while any(worker.process.poll() is None for worker in workers):
        now = time.time()
        if first_failure is None and any(worker_failed(worker) for worker in workers):
            first_failure = now
        if first_failure is not None and now - first_failure > FAILED_PEER_GRACE_S:
            for worker in workers:
                worker.stopped = worker.process.poll() is None
            return
        late = [worker for worker in workers if running_late(worker, budgets, now)]
        if late:
            for worker in workers:
                worker.stopped_late = worker in late
                worker.stopped = worker not in late and worker.process.poll() is None
            return
        time.sleep(POLL_S)


def worker_failed(worker: LocalRank) -> bool:
    code = worker.process.poll()
    if code not in (None, 0):
        return True
    return any(not record.get("ok", True) for record in ended_stages(worker.stage_file))


def running_late(worker: LocalRank, budgets: dict[str, float], now: float) -> bool:
    if worker.process.poll() is not None:
        return False
    stage, since = open_stage(worker.stage_file)
    if stage is None and not ended_stages(worker.stage_file):
        stage, since = "start", worker.spawned_at
    if stage is None:
        return False
    return now - since > budgets.get(stage, START_BUDGET_S) + PARENT_GRACE_S


def stop_workers(workers: list[LocalRank]) -> None:
    """SIGTERM each worker's process group, then SIGKILL what is left: nothing outlives us."""
    alive = [worker.process for worker in workers if worker.process.poll() is None]
    for process in alive:
        signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    for process in alive:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(process, signal.SIGKILL)
            process.wait()


def signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
        os.killpg(process.pid, signum)


def read_stage_log(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        with contextlib.suppress(ValueError):  # a line the worker is still writing
            records.append(json.loads(line))
    return records


def ended_stages(path: Path) -> list[dict]:
    return [record for record in read_stage_log(path) if record["event"] == "end"]


def open_stage(path: Path) -> tuple[str | None, float]:
    """The stage begun and not yet ended, with when it began."""
    begun: dict[str, float] = {}
    for record in read_stage_log(path):
        if record["event"] == "begin":
            begun[record["stage"]] = record["t"]
        else:
            begun.pop(record["stage"], None)
    if not begun:
        return None, 0.0
    stage = max(begun, key=begun.get)
    return stage, begun[stage]


def rank_outcome(worker: LocalRank, budgets: dict[str, float], node: dict) -> dict:
    stages = [
        {key: record.get(key) for key in ("stage", "ok", "seconds", "detail", "data")}
        for record in ended_stages(worker.stage_file)
    ]
    unfinished, _ = open_stage(worker.stage_file)
    if unfinished is None and not stages:
        unfinished = "start"
    code = worker.process.returncode
    if unfinished:
        stages.append(
            {
                "stage": unfinished,
                "ok": False,
                "detail": unfinished_reason(worker, unfinished, budgets),
            }
        )
    elif code not in (0, None) and all(stage["ok"] for stage in stages):
        stages.append({"stage": "exit", "ok": False, "detail": exit_reason(worker)})
    return {
        "rank": worker.rank,
        "local_rank": worker.local_rank,
        "node_rank": node["node_rank"],
        "host": node["host"],
        "address": node["address"],
        "exit_code": code,
        "stages": stages,
    }


def unfinished_reason(worker: LocalRank, stage: str, budgets: dict[str, float]) -> str:
    if worker.stopped_late:
        return f"still running after {budgets.get(stage, START_BUDGET_S):g}s: stopped by the probe"
    if worker.stopped:
        return "stopped after another rank failed or ran late"
    return exit_reason(worker)


def exit_reason(worker: LocalRank) -> str:
    code = worker.process.returncode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    tail = log_tail(worker.log_file)
    return f"{how}: {tail}" if tail else how


def log_tail(path: Path, lines: int = 2) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    useful = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith(("frame #", "Exception raised", "<omit"))
    ]
    return " | ".join(useful[-lines:])[:400]


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def exchange_outcomes(store, plan: ProbePlan, layout: RankLayout, nodes, local: list[dict]):
    """Every node's ranks, swapped through the store; what never came is marked unknown."""
    if plan.nnodes == 1:
        return local
    keys = [f"probe/outcome/{rank}" for rank in range(plan.nnodes)]
    wait_s = 2 * plan.stage_timeout + 15  # the slowest node may still be timing a stage out
    outcomes = list(local)
    try:
        store.set(keys[plan.node_rank], json.dumps(local))
        wait_for_keys(store, keys, wait_s)
        for node_rank, key in enumerate(keys):
            if node_rank == plan.node_rank:
                continue
            if store.check([key]):
                outcomes += json.loads(store.get(key))
            else:
                outcomes += unknown_outcomes(layout, nodes[node_rank], "sent no report")
        store.add("probe/read", 1)
        if plan.hosts_store:  # keep the store up until every node has read the outcomes
            deadline = time.monotonic() + wait_s
            while store.add("probe/read", 0) < plan.nnodes and time.monotonic() < deadline:
                time.sleep(0.2)
    except Exception as error:  # node 0 went away: report what this node knows
        reached = {outcome["node_rank"] for outcome in outcomes}
        for node in nodes:
            if node["node_rank"] not in reached:
                reason = f"unknown: node 0's store closed ({first_line(error)})"
                outcomes += unknown_outcomes(layout, node, reason)
    return sorted(outcomes, key=lambda outcome: outcome["rank"])


def unknown_outcomes(layout: RankLayout, node: dict, reason: str) -> list[dict]:
    return [
        {
            "rank": rank,
            "local_rank": local_rank,
            "node_rank": node["node_rank"],
            "host": node["host"],
            "address": node["address"],
            "exit_code": None,
            "stages": [{"stage": "report", "ok": False, "detail": reason}],
        }
        for local_rank, rank in enumerate(layout.ranks_of(node["node_rank"]))
    ]


# --- Rows from the outcomes ---------------------------------------------------------------------


def stage_rows(outcomes: list[dict]) -> list[Row]:
    rows = []
    for stage in (*STAGES, "exit", "report"):
        results = [
            (outcome, record)
            for outcome in outcomes
            for record in outcome["stages"]
            if record["stage"] == stage
        ]
        if not results:
            continue
        failed = [(outcome, record) for outcome, record in results if not record["ok"]]
        title = STAGE_TITLES.get(stage, stage)
        if failed:
            fix = failure_hint(failed) + STAGE_FIXES.get(stage, "")
            rows.append(fail(title, describe_failures(failed), fix))
        elif stage != "start":
            rows.append(ok(title, summarize(stage, results)))
    return rows


def describe_failures(failed: list[tuple[dict, dict]]) -> str:
    """Ranks that failed the same way share one line: 'ranks 0,1 on node 0 (...): why'."""
    by_reason: dict[str, list[dict]] = {}
    for outcome, record in failed:
        by_reason.setdefault(clean_detail(record["detail"] or ""), []).append(outcome)
    shown = [f"{ranks_on_nodes(outcomes)}: {reason}" for reason, outcomes in by_reason.items()]
    more = f"; and {len(shown) - 3} more" if len(shown) > 3 else ""
    return "; ".join(shown[:3]) + more


def clean_detail(detail: str) -> str:
    """Drop what the row already says (the rank) and C++ source locations."""
    detail = re.sub(r"^rank \d+: ", "", detail)
    return re.sub(r"\[(enforce fail at )?/[^\]]*\]\s*", "", detail)


def ranks_on_nodes(outcomes: list[dict]) -> str:
    by_node: dict[str, list[str]] = {}
    for outcome in outcomes:
        by_node.setdefault(node_label(outcome), []).append(str(outcome["rank"]))
    return ", ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {','.join(ranks)} on {node}"
        for node, ranks in by_node.items()
    )


def failure_hint(failed: list[tuple[dict, dict]]) -> str:
    """The cause some error messages give away, said in the user's terms."""
    details = " ".join(record["detail"] or "" for _, record in failed)
    addresses = " ".join(outcome.get("address") or "" for outcome, _ in failed)
    if re.search(r"remote=\[(127\.|::1\])", details) or re.search(r"\b127\.", addresses):
        return (
            "a rank advertised a loopback address, which other nodes cannot reach: pass --ifname "
            "with the interface the nodes share. "
        )
    if "Unable to find address for" in details:
        return "the interface named for Gloo/NCCL holds no address or is down: name another. "
    return ""


def summarize(stage: str, results: list[tuple[dict, dict]]) -> str:
    ranks = len(results)
    data = [record.get("data") or {} for _, record in results]
    seconds = max(record.get("seconds") or 0 for _, record in results)
    if stage == "init":
        return f"{ranks} rank(s) joined ({results[0][1]['detail']}) in {seconds:.1f}s"
    if stage == "all_reduce":
        return f"the sum over {ranks} rank(s) is exact on every rank"
    if stage == "facts":
        nodes = len({outcome["node_rank"] for outcome, _ in results})
        return f"gathered from {ranks} rank(s) on {nodes} node(s)"
    if stage == "barrier":
        p50 = max(item.get("p50_us", 0) for item in data)
        worst = max(item.get("max_us", 0) for item in data)
        return f"p50 {p50:.0f} µs, max {worst:.0f} µs (slowest rank, {BARRIER_ITERATIONS} barriers)"
    if stage == "bandwidth":
        return results[0][1]["detail"]
    if stage == "p2p":
        per_node = {o["node_rank"]: (r.get("data") or {}).get("node_pairs", 0) for o, r in results}
        pairs = sum(per_node.values())
        return f"every pair of GPUs on each node ({pairs} pair(s)) swapped data intact"
    return f"{ranks} rank(s) passed"


def rank_rows(outcomes: list[dict]) -> list[Row]:
    rows = []
    for outcome in outcomes:
        marks = " ".join(
            f"{record['stage']} {'✓' if record['ok'] else '✗'}"
            for record in outcome["stages"]
            if record["stage"] != "start" or not record["ok"]
        )
        name, detail = f"rank {outcome['rank']}", f"{node_label(outcome)} · {marks}"
        if all(record["ok"] for record in outcome["stages"]):
            rows.append(ok(name, detail))
        else:
            rows.append(fail(name, detail, "see the failed stage above"))
    return rows


FACT_RULES = (
    ("torch", "torch", FAIL, "install the same torch build on every node (one container image)"),
    ("cuda", "CUDA", FAIL, "install the same torch build (same CUDA) on every node"),
    ("nccl", "NCCL", FAIL, "use the torch wheel's own NCCL everywhere (check LD_LIBRARY_PATH)"),
    ("cudnn", "cuDNN", WARN, "install the same torch build on every node"),
    ("python", "Python", WARN, "use the same Python version on every node"),
    ("gpu", "GPU model", WARN, "mixed GPU models run at the pace of the slowest one"),
    ("tag", PROBE_TAG_VARIABLE, FAIL, "every node should run the same image or release"),
)


def consistency_rows(records: list[dict], nodes: list[dict]) -> list[Row]:
    """Flag every setting that differs between nodes (or, for the GPU model, between ranks)."""
    rows = []
    for key, title, status, fix in FACT_RULES:
        values = values_by_origin(records, key)
        if len(values) > 1:
            rows.append(Row(f"mismatch: {title}", status, describe_values(values), fix))
    rows.extend(settings_rows(records))
    nprocs = {node_label(node): str(node["nproc"]) for node in nodes}
    if len(set(nprocs.values())) > 1:
        rows.append(
            Row(
                "mismatch: processes per node",
                WARN,
                describe_values(group_labels(nprocs)),
                "give every node the same --nproc unless the nodes differ on purpose",
            )
        )
    if rows:
        return rows
    first = records[0]
    return [
        ok(
            "same on every node",
            f"torch {first['torch']}, CUDA {first['cuda'] or 'none'}, NCCL "
            f"{first['nccl'] or 'none'}, Python {first['python']} on {len(nodes)} node(s)",
        )
    ]


def values_by_origin(records: list[dict], key: str) -> dict[str, list[str]]:
    by_origin = {}
    for record in records:
        origin = node_label(record)
        if key == "gpu" and "rank" in record:  # one node may hold different GPU models
            origin = f"rank {record['rank']} on {origin}"
        by_origin[origin] = str(record.get(key) or "unset")
    return group_labels(by_origin)


def group_labels(by_origin: dict[str, str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for origin, value in by_origin.items():
        grouped.setdefault(value, []).append(origin)
    return grouped


def describe_values(values: dict[str, list[str]]) -> str:
    return "; ".join(f"{value} on {', '.join(origins)}" for value, origins in values.items())


def settings_rows(records: list[dict]) -> list[Row]:
    names = sorted({name for record in records for name in record.get("settings", {})})
    rows = []
    for name in names:
        by_origin = {node_label(r): r.get("settings", {}).get(name, "unset") for r in records}
        values = group_labels(by_origin)
        if len(values) > 1:
            rows.append(
                Row(
                    f"mismatch: {name}",
                    WARN,
                    describe_values(values),
                    f"set {name} the same way on every node (or nowhere): nodes that disagree "
                    "may pick different transports and hang at init",
                )
            )
    return rows


# --- The worker -----------------------------------------------------------------------------------


class StageFailed(Exception):
    pass


@dataclass
class StageResult:
    detail: str
    data: dict = field(default_factory=dict)
    value: Any = None


class StageLog:
    """This rank's stages, one JSON line per event, appended as they happen; the parent
    reads the file to know where each rank is, even if the rank dies."""

    def __init__(self, path: Path, budgets: dict[str, float]):
        self.path = path
        self.budgets = budgets
        self.lock = threading.Lock()
        self.current: str | None = None
        self.began = 0.0

    def write(self, record: dict) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def started(self, seconds: float) -> None:
        self.write(
            {"stage": "start", "event": "end", "ok": True, "seconds": round(seconds, 3),
             "detail": "", "data": {}}
        )  # fmt: skip

    def begin(self, stage: str) -> None:
        with self.lock:
            self.current, self.began = stage, time.time()
            self.write({"stage": stage, "event": "begin", "t": self.began})

    def end(self, stage: str, passed: bool, detail: str, data: dict | None = None) -> bool:
        """False if the stage was already closed (by the watchdog)."""
        with self.lock:
            if self.current != stage:
                return False
            self.current = None
            seconds = round(time.time() - self.began, 4)
            self.write(
                {"stage": stage, "event": "end", "ok": passed, "seconds": seconds,
                 "detail": detail, "data": data or {}}
            )  # fmt: skip
            return True

    def overdue(self) -> tuple[str, float] | None:
        with self.lock:
            if self.current is None:
                return None
            budget = self.budgets[self.current]
            return (self.current, budget) if time.time() - self.began > budget else None


def start_watchdog(log: StageLog, parent_pid: int) -> None:
    """A stage that overruns its budget ends the process; so does losing the parent."""

    def watch() -> None:
        while True:
            time.sleep(0.2)
            if os.getppid() != parent_pid:
                os._exit(1)
            late = log.overdue()
            if late and log.end(late[0], False, f"timed out after {late[1]:g}s"):
                os._exit(1)

    threading.Thread(target=watch, name="probe-watchdog", daemon=True).start()


def run_stage(log: StageLog, stage: str, action: Callable[[], StageResult]) -> Any:
    from ddpcli.errors import DdpcliError

    log.begin(stage)
    try:
        result = action()
    except Exception as error:
        detail = error.message if isinstance(error, DdpcliError) else first_line(error)
        log.end(stage, False, detail)
        raise StageFailed(stage) from error
    log.end(stage, True, result.detail, result.data)
    return result.value


def run_stages(env, request: dict, log: StageLog) -> None:
    from ddpcli.dist import shutdown

    ctx = run_stage(log, "init", lambda: join_group(env, request))
    run_stage(log, "all_reduce", lambda: check_all_reduce(ctx))
    run_stage(log, "facts", lambda: gather_facts(ctx, request))
    run_stage(log, "barrier", lambda: measure_barrier(ctx))
    run_stage(log, "bandwidth", lambda: measure_bandwidth(ctx, request["message_bytes"]))
    local_ranks = request["node_ranks"][ctx.node_rank]
    if ctx.device.type == "cuda" and len(local_ranks) > 1:
        run_stage(log, "p2p", lambda: check_peer_to_peer(ctx, local_ranks))
    shutdown()


def join_group(env, request: dict) -> StageResult:
    from ddpcli.dist import init_distributed

    ctx = init_distributed(
        env,
        want_gpu=request["use_gpus"],
        backend=request["backend"],
        init_method="env://",  # always form a group, even of one rank
        timeout_s=request["stage_timeout"],
    )
    return StageResult(f"{ctx.backend}, {ctx.device}", {"device": str(ctx.device)}, ctx)


def synchronize(ctx) -> None:
    import torch

    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def check_all_reduce(ctx) -> StageResult:
    """Each rank fills its own row with rank+1: after the sum, row r must hold r+1 everywhere,
    which catches a lost, doubled or misplaced contribution."""
    import torch
    import torch.distributed as dist

    rows = torch.zeros(ctx.world_size, 1024, device=ctx.device)
    rows[ctx.rank] = ctx.rank + 1
    dist.all_reduce(rows)
    synchronize(ctx)
    expected = torch.arange(1, ctx.world_size + 1, device=ctx.device, dtype=rows.dtype)
    wrong = (rows != expected.unsqueeze(1)).any(dim=1).nonzero().flatten().tolist()
    if wrong:
        raise RuntimeError(f"wrong sum: the contributions of ranks {wrong} came back altered")
    return StageResult("exact")


def gather_facts(ctx, request: dict) -> StageResult:
    import torch.distributed as dist

    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, rank_facts(ctx, request))
    if ctx.local_rank == 0:
        target = Path(request["workdir"]) / FACTS_FILE
        partial = target.with_suffix(".part")
        partial.write_text(json.dumps(everyone))
        partial.replace(target)  # the parent never reads half a file
    return StageResult(f"{len(everyone)} ranks")


def rank_facts(ctx, request: dict) -> dict:
    import torch

    gpu = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    return {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "node_rank": ctx.node_rank,
        "host": socket.gethostname(),
        "address": address_for(request["ifname"], request["master_addr"]) or "",
        "gpu": gpu,
        **comparable_facts(software_versions(with_driver=False)),
    }


def measure_barrier(ctx) -> StageResult:
    import torch.distributed as dist

    for _ in range(3):  # the first barriers set up connections
        dist.barrier()
    samples = []
    for _ in range(BARRIER_ITERATIONS):
        started = time.perf_counter()
        dist.barrier()
        synchronize(ctx)
        samples.append((time.perf_counter() - started) * 1e6)
    samples.sort()
    data = {
        "p50_us": samples[len(samples) // 2],
        "p90_us": samples[int(len(samples) * 0.9)],
        "max_us": samples[-1],
    }
    return StageResult(f"p50 {data['p50_us']:.0f} µs", data)


def measure_bandwidth(ctx, message_bytes: int) -> StageResult:
    import torch
    import torch.distributed as dist

    message = torch.ones(message_bytes // 4, device=ctx.device)
    dist.all_reduce(message)  # warm-up: NCCL builds its rings on first use
    synchronize(ctx)
    started = time.perf_counter()
    for _ in range(BANDWIDTH_ITERATIONS):
        dist.all_reduce(message)
    synchronize(ctx)
    seconds = (time.perf_counter() - started) / BANDWIDTH_ITERATIONS
    algorithm = message_bytes / seconds / 1e9
    # Bus bandwidth, as nccl-tests reports it: what each link carried in a ring all_reduce.
    bus = algorithm * 2 * (ctx.world_size - 1) / ctx.world_size
    data = {"bytes": message_bytes, "ms": seconds * 1e3, "algbw_gbps": algorithm, "busbw_gbps": bus}
    size = f"{message_bytes / 2**20:.0f} MiB"
    if ctx.world_size == 1:
        return StageResult(f"{size} in {seconds * 1e3:.1f} ms (one rank: no traffic)", data)
    return StageResult(
        f"{size} in {seconds * 1e3:.1f} ms: {bus:.2f} GB/s bus bandwidth "
        f"({algorithm:.2f} GB/s algorithm)",
        data,
    )


def check_peer_to_peer(ctx, local_ranks: list[int]) -> StageResult:
    """Every pair of this node's GPUs swaps a message directly (NCCL send/recv)."""
    import torch
    import torch.distributed as dist

    pairs = 0
    for first, second in itertools.combinations(local_ranks, 2):
        if ctx.rank not in (first, second):
            continue
        peer = second if ctx.rank == first else first
        outgoing = torch.full((P2P_MESSAGE_BYTES // 4,), float(ctx.rank), device=ctx.device)
        incoming = torch.empty_like(outgoing)
        operations = [
            dist.P2POp(dist.isend, outgoing, peer),
            dist.P2POp(dist.irecv, incoming, peer),
        ]
        for request in dist.batch_isend_irecv(operations):
            request.wait()
        synchronize(ctx)
        if not bool((incoming == peer).all()):
            raise RuntimeError(f"data from rank {peer} arrived altered (GPU peer-to-peer)")
        pairs += 1
    dist.barrier()
    node_pairs = len(local_ranks) * (len(local_ranks) - 1) // 2
    return StageResult(f"{pairs} pair(s) with this rank", {"node_pairs": node_pairs})


def main(argv: list[str]) -> None:
    began = time.time()
    request = json.loads(Path(argv[1]).read_text())
    from ddpcli.environments import read_launcher_env
    from ddpcli.process import collect_then_freeze

    env = read_launcher_env()
    log = StageLog(Path(request["workdir"]) / f"rank-{env.rank}.jsonl", request["budgets"])
    log.started(time.time() - began)
    start_watchdog(log, request["parent_pid"])
    try:
        run_stages(env, request, log)
        collect_then_freeze()
    except StageFailed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip atexit hooks that could wait on peers that are gone


if __name__ == "__main__":
    main(sys.argv)
