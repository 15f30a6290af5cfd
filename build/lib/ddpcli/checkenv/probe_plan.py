"""What `--probe` will do on this node: the backend, the processes, where the store lives,
each stage's deadline, and the request every probe worker reads. Plain data: the parent
(ddpcli.checkenv.probe) and the workers (probe_worker) both build on it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ddpcli.checkenv.facts import Master, NodeFacts
from ddpcli.checkenv.report import Row, fail
from ddpcli.config.checkenv import CheckEnvOptions

STAGES = ("start", "init", "all_reduce", "facts", "barrier", "bandwidth", "p2p")
START_BUDGET_S = 60.0  # importing torch on a loaded machine
CPU_MESSAGE_BYTES = 16 * 2**20
GPU_MESSAGE_BYTES = 256 * 2**20
BARRIER_ITERATIONS = 20
FACTS_FILE = "facts.json"  # every rank's facts, written by the node's local rank 0
REQUEST_FILE = "request.json"


def stage_file(workdir: Path, rank: int) -> Path:
    """Where rank `rank` logs its stages, one JSON line per event (probe_worker.StageLog)."""
    return workdir / f"rank-{rank}.jsonl"


@dataclass
class ProbePlan:
    backend: str  # gloo | nccl, resolved
    nproc: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int  # 0: a one-node probe given no port lets the store pick a free one
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
    backend = probe_backend(options, facts)
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
        port = options.master_port if options.port_given else 0
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


def probe_backend(options: CheckEnvOptions, facts: NodeFacts) -> str | Row:
    """The backend the probe's processes use on this node, or the row that says why none
    can (before any process starts, unlike ddpcli.dist.choose_backend inside a worker)."""
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
class ProbeRequest:
    """What a parent tells its probe workers, in REQUEST_FILE in the work folder."""

    workdir: str
    parent_pid: int
    backend: str
    use_gpus: bool
    stage_timeout: float
    budgets: dict[str, float]  # seconds per stage
    message_bytes: int  # the bandwidth stage's all_reduce
    node_ranks: list[list[int]]  # the global ranks of each node
    master_addr: str
    ifname: str | None

    @classmethod
    def for_plan(
        cls, plan: ProbePlan, layout: RankLayout, workdir: Path, parent_pid: int
    ) -> ProbeRequest:
        return cls(
            workdir=str(workdir),
            parent_pid=parent_pid,
            backend=plan.backend,
            use_gpus=plan.use_gpus,
            stage_timeout=plan.stage_timeout,
            budgets=plan.budgets(max(layout.procs_per_node)),
            message_bytes=GPU_MESSAGE_BYTES if plan.use_gpus else CPU_MESSAGE_BYTES,
            node_ranks=[layout.ranks_of(node) for node in range(len(layout.procs_per_node))],
            master_addr=plan.master_addr,
            ifname=plan.ifname,
        )

    def write(self) -> Path:
        path = Path(self.workdir) / REQUEST_FILE
        path.write_text(json.dumps(asdict(self)))
        return path

    @classmethod
    def read(cls, path: Path) -> ProbeRequest:
        return cls(**json.loads(Path(path).read_text()))
